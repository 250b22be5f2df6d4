"""The routings a mixture answers by, named as `dipaco.load(route=...)`, `--route` and the harness's `route=`
take them: "router" (the k-means router), "likelihood" (every path reads the prompt's prefix, the lowest loss
wins) and "likelihood:K" (the same among the router's K best paths). No torch here: the CLI checks --route with it.

    parse_route("likelihood:4")   # ("likelihood", 4)
"""

from __future__ import annotations

import argparse

from dipaco.config import parse_mode

ROUTES = ("router", "likelihood")  # plus likelihood:K


def parse_route(route: str) -> tuple[str, int]:
    """`"router"` -> `("router", 0)`; `"likelihood"` -> `("likelihood", 0)` (every path); `"likelihood:4"` ->
    `("likelihood", 4)` (among the router's 4 best paths); anything else is an error."""
    if route == "router":
        return "router", 0
    try:
        kind, k = parse_mode(str(route))  # the eval modes' own parser: likelihood and likelihood:K read alike
    except ValueError:
        kind = ""
    if kind != "likelihood":
        raise ValueError(f"route must be one of {list(ROUTES)} or likelihood:K (K >= 1, e.g. likelihood:4), got {route!r}")
    return kind, k


def route_arg(route: str) -> str:
    """argparse `type=` for --route: the route itself, refused as `parse_route` refuses it (with its words)."""
    try:
        parse_route(route)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return route
