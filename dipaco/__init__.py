"""dipaco: train DiPaCo-style mixture-of-paths language models across loosely connected islands.

The pipeline (see README): `routing` assigns documents to paths, `sharding` writes path-specific
shards, and this package trains paths on islands with DiLoCo inner steps, averages shared modules in
the outer step, and evaluates with one routed path per sequence. Run `dipaco --help`.
"""

__version__ = "0.1.0"
