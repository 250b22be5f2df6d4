"""dipaco: train DiPaCo-style mixture-of-paths language models across loosely connected islands.

The pipeline (see README): `routing` assigns documents to paths, `sharding` writes path-specific
shards, and this package trains paths on islands with DiLoCo inner steps, averages shared modules in
the outer step, and evaluates with one routed path per sequence. Run `dipaco --help`.

A trained mixture, exported with `dipaco export DIR --run RUN`, is one object:

    import dipaco
    mixture = dipaco.load("out/demo")          # or route="likelihood"; docs/use-your-model.md
    print(mixture.generate("In the beginning", max_new_tokens=20))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dipaco.inference.mixture import Mixture

__version__ = "0.1.0"


def load(directory, *, route: str | None = None, max_loaded: int | None = None, device="cpu") -> Mixture:
    """The mixture `dipaco export` wrote to `directory` (`dipaco.inference.mixture.Mixture`): `route` is
    "router" (the k-means router) or "likelihood" (default: the export's choice), `max_loaded` caps the
    path models kept in memory. Imported on call, so `import dipaco` stays light."""
    from dipaco.inference.mixture import load as load_mixture

    return load_mixture(directory, route=route, max_loaded=max_loaded, device=device)
