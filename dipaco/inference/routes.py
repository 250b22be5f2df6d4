"""The routings a mixture answers by, named as `dipaco.load(route=...)`, `--route` and the harness's `route=`
take them: "router" (the k-means router), "likelihood" (every path reads the prompt's prefix, the lowest loss
wins) and "likelihood:K" (the same among the router's K best paths). No torch here: the CLI checks --route with it.

    parse_route("likelihood:4")   # ("likelihood", 4)
"""

from __future__ import annotations

import argparse

ROUTES = ("router", "likelihood")  # plus likelihood:K


def parse_route(route: str) -> tuple[str, int]:
    """`"router"` -> `("router", 0)`; `"likelihood"` -> `("likelihood", 0)` (every path); `"likelihood:4"` ->
    `("likelihood", 4)` (among the router's 4 best paths); anything else is an error."""
    kind, _, k = str(route).partition(":")
    if route in ROUTES or (kind == "likelihood" and k.isdigit() and int(k) >= 1):
        return kind, int(k or 0)
    raise ValueError(f"route must be one of {list(ROUTES)} or likelihood:K (K >= 1, e.g. likelihood:4), got {route!r}")


def route_arg(route: str) -> str:
    """argparse `type=` for --route: the route itself, refused as `parse_route` refuses it (with its words)."""
    try:
        parse_route(route)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return route
