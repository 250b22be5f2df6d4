"""Using a trained mixture: one exported directory (`manifest`), loaded as a `Mixture` that routes each
prompt to one path and generates with it (`mixture`, `path_cache`), the routing shared with
`dipaco generate` (`prompt_routing`, `continuation`), an lm-evaluation-harness model type (`harness`)
and an HTTP completions server (`server`).

    import dipaco
    mixture = dipaco.load("out/demo")               # written by `dipaco export out/demo --run runs/demo`
    print(mixture.generate("In the beginning", max_new_tokens=20))

May import `dipaco.eval`, `dipaco.model`, `dipaco.config`, `dipaco.device`, `routing` and `sharding` (and
`lm_eval` in `harness` and `side_by_side` alone); never a stage or an island.
"""
