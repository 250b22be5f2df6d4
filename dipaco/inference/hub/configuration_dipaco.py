"""The configuration of a DiPaCo mixture exported as a Hugging Face repository (`dipaco export DIR`).

This file is copied into the exported directory and loaded from there with `trust_remote_code=True`;
it imports only transformers (no dipaco):

    from transformers import AutoConfig
    config = AutoConfig.from_pretrained("out/demo", trust_remote_code=True)
    config.levels, config.paths, config.route, config.router["featurizer"]

Fields: `llama` (every path's LlamaConfig as a dict, written with both `rope_theta` and
`rope_parameters` so transformers 4 and 5 read it), the grid (`levels`, `replicas`, `level_blocks`,
`private_blocks`, `private_embeddings`), `paths` ({path id: {module: the name its tensors are stored under}};
the name is the module's own unless paths use it at different versions, `--best`), the routing
(`route`: "router" or "likelihood", `prefix_tokens`, `router`: the k-means router's description; its
arrays are tensors `router.*` in the weights) and `max_length` (the sequence length paths saw).
"""

from __future__ import annotations

from transformers import PretrainedConfig


class DipacoConfig(PretrainedConfig):
    """A routed mixture of paths: each sequence goes to one path, a Llama model built from shared modules."""

    model_type = "dipaco_mixture"

    def __init__(self, llama: dict | None = None, levels: list[int] | None = None, replicas: int = 1,
                 level_blocks: list[list[int]] | None = None, private_blocks: list[int] | None = None,
                 private_embeddings: bool = False, paths: dict[str, dict[str, str]] | None = None,
                 route: str = "router", prefix_tokens: int = 32, router: dict | None = None,
                 max_length: int = 2048, **kwargs):
        self.llama = dict(llama or {})
        self.levels = list(levels or [1])
        self.replicas = int(replicas)
        self.level_blocks = [list(b) for b in (level_blocks or [])]
        self.private_blocks = list(private_blocks or [])
        self.private_embeddings = bool(private_embeddings)
        self.paths = {str(k): dict(v) for k, v in (paths or {}).items()}
        if route not in ("router", "likelihood"):
            raise ValueError(f"DipacoConfig: route must be 'router' or 'likelihood', got {route!r}")
        self.route = route
        self.prefix_tokens = int(prefix_tokens)
        self.router = dict(router) if router else None
        self.max_length = int(max_length)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key in self.llama:  # what generation and pipelines read from the top-level config
                kwargs.setdefault(key, self.llama[key])
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            kwargs.setdefault(key, self.llama.get(key))
        kwargs.setdefault("tie_word_embeddings", False)  # the mixture itself ties nothing; its paths may
        super().__init__(**kwargs)
