"""A DiPaCo mixture as a transformers model: every module stored once, each path built from its modules on
demand, each sequence routed to one path by its first `prefix_tokens` tokens.

This file is copied into a directory `dipaco export DIR` writes and loaded from there; it imports only
torch and transformers, so the mixture runs on a machine without dipaco:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained("out/demo")
    model = AutoModelForCausalLM.from_pretrained("out/demo", trust_remote_code=True)
    ids = tok("In the beginning", return_tensors="pt").input_ids
    print(tok.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0]), model.last_paths)

Weights: `grid.<module>.<parameter>` (e.g. `grid.level0.module1.model.layers.0.mlp.up_proj.weight`), each
module once, and the k-means router's arrays `router.<name>`. Routing (`config.route`):
- "router": the prefix's text (the tokens decoded as `dipaco route` decodes them) is featurized
  (TF-IDF -> SVD -> L2, recomputed here from the stored vocabulary, idf and components; or the mean last
  hidden state of the featurizer model in `featurizer/`), and the path with the lowest cost (squared
  distance to its centroids plus its penalty, or -(W x + b)) is taken;
- "likelihood": the path whose model gives the prefix the lowest total loss (fp32, one at a time).
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter, OrderedDict

import torch
from torch import nn
from transformers import GenerationMixin, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_dipaco import DipacoConfig

log = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn's TfidfVectorizer token pattern


def module_of_param(config: DipacoConfig, name: str, path: int) -> str:
    """The module that holds parameter `name` of path `path` (dipaco.model.topology's naming)."""
    owner = path // config.replicas
    match = _LAYER.match(name)
    if not match:
        return f"path{owner:03d}.embeddings" if config.private_embeddings else "embeddings"
    block = int(match.group(1))
    if block in config.private_blocks:
        return f"path{owner:03d}.block{block:02d}"
    level = next(i for i, blocks in enumerate(config.level_blocks) if block in blocks)
    choice = _unravel(owner, config.levels)
    return f"level{level}.module{choice[level]}"


def _unravel(index: int, levels: list[int]) -> list[int]:
    """The module choice per level of a routed path (level 0 most significant)."""
    choice = []
    for k in reversed(levels):
        index, c = divmod(index, k)
        choice.append(c)
    return choice[::-1]


def _container(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    """The nested module for every part of `dotted` but the last (made when missing), and the last part."""
    *parts, leaf = dotted.split(".")
    for part in parts:
        if part not in root._modules:
            root.add_module(part, nn.Module())
        root = root._modules[part]
    return root, leaf


def llama_config(config: DipacoConfig) -> LlamaConfig:
    """Every path's architecture."""
    skip = ("model_type", "transformers_version", "architectures", "auto_map")
    return LlamaConfig(**{k: v for k, v in config.llama.items() if k not in skip})


class DipacoMixtureForCausalLM(PreTrainedModel, GenerationMixin):
    """The routed mixture: `generate` and `forward` route each sequence to one path (`last_paths`)."""

    config_class = DipacoConfig
    base_model_prefix = "dipaco"
    _no_split_modules: list[str] = []

    def __init__(self, config: DipacoConfig, max_loaded: int | None = None):
        super().__init__(config)
        self.grid = nn.Module()
        self.router = nn.Module()
        llama = llama_config(config)
        with torch.device("meta"):
            template = dict(LlamaForCausalLM(llama).named_parameters())
        if llama.tie_word_embeddings:  # the head is the embedding (from_pretrained may build untied)
            template.pop("lm_head.weight", None)
        self._names: dict[str, list[str]] = {}  # stored module -> its parameters' names in a path model
        for path in sorted(int(p) for p in config.paths):
            for name, param in template.items():
                stored = config.paths[str(path)][module_of_param(config, name, path)]
                if name in self._names.setdefault(stored, []):
                    continue
                self._names[stored].append(name)
                holder, leaf = _container(self.grid, f"{stored}.{name}")
                holder.register_parameter(leaf, nn.Parameter(torch.empty(param.shape), requires_grad=False))
        for name, shape in ((config.router or {}).get("tensors") or {}).items():
            holder, leaf = _container(self.router, name)
            holder.register_buffer(leaf, torch.empty(shape))
        self.max_loaded = max_loaded
        self._paths: OrderedDict[int, LlamaForCausalLM] = OrderedDict()
        self._featurizer = None
        self._tokenizer = None
        self.last_paths: list[int] = []  # the path of each sequence of the last forward / generate
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing to initialise: every tensor comes from the checkpoint."""

    # ---- paths ----
    @property
    def path_ids(self) -> list[int]:
        return sorted(int(p) for p in self.config.paths)

    def path_model(self, path: int) -> LlamaForCausalLM:
        """Path `path` as a LlamaForCausalLM assembled from its modules (kept; `max_loaded` the most kept)."""
        if path in self._paths:
            self._paths.move_to_end(path)
            return self._paths[path]
        if str(path) not in self.config.paths:
            raise ValueError(f"the mixture has paths {self.path_ids}, not {path}")
        state = {}
        for stored in self.config.paths[str(path)].values():
            holder = self.grid.get_submodule(stored)
            state.update({name: holder.get_parameter(name) for name in self._names[stored]})
        model = LlamaForCausalLM(llama_config(self.config))
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"path {path}: modules {self.config.paths[str(path)]} miss {missing[:3]}, "
                             f"have extra {unexpected[:3]}")
        dtype = next(self.grid.parameters()).dtype
        model = model.to(device=self.device, dtype=dtype).eval()
        self._paths[path] = model
        while self.max_loaded is not None and len(self._paths) > self.max_loaded:
            self._paths.popitem(last=False)
        return model

    # ---- routing ----
    def set_tokenizer(self, tokenizer) -> None:
        """The tokenizer routing decodes prefixes with (default: the one in this directory)."""
        self._tokenizer = tokenizer

    def route(self, sequences: list[torch.Tensor]) -> list[int]:
        """The path of each token sequence (1-D tensors), from its first `prefix_tokens` tokens."""
        prefixes = [s[: self.config.prefix_tokens].to(self.device) for s in sequences]
        if self.config.route == "likelihood":
            return self._likelihood_paths(prefixes)
        texts = [self._decoder().decode([int(t) for t in p], skip_special_tokens=False) for p in prefixes]
        features = self._features(texts)  # (N, dim) float32
        routed = self._path_costs(features).argmin(dim=1)  # (N,) first on ties
        return [int(q) * self.config.replicas for q in routed]

    @torch.no_grad()
    def _likelihood_paths(self, prefixes: list[torch.Tensor]) -> list[int]:
        paths = self.path_ids
        losses = torch.zeros(len(paths), len(prefixes), dtype=torch.float64)
        for i, path in enumerate(paths):
            model = self.path_model(path)
            for j, prefix in enumerate(prefixes):
                if len(prefix) < 2:
                    raise ValueError(f"likelihood routing needs a prompt of at least 2 tokens, got {len(prefix)}")
                logits = model(input_ids=prefix[None]).logits[0, :-1].float()  # (T-1, V)
                nll = -torch.log_softmax(logits, dim=-1).gather(-1, prefix[1:, None]).squeeze(-1)
                losses[i, j] = nll.double().sum()
        return [paths[int(k)] for k in losses.argmin(dim=0)]

    def _decoder(self):
        if self._tokenizer is None:
            from transformers import PreTrainedTokenizerFast

            # not AutoTokenizer: it reads config.json, whose auto_map makes transformers ask about this code
            self._tokenizer = PreTrainedTokenizerFast.from_pretrained(self.config.name_or_path)
        return getattr(self._tokenizer, "backend_tokenizer", self._tokenizer)

    def _features(self, texts: list[str]) -> torch.Tensor:
        kind = self.config.router["featurizer"]
        if kind == "tfidf":
            return self._tfidf(texts)
        return self._model_features(texts)

    def _tfidf(self, texts: list[str]) -> torch.Tensor:
        """TF-IDF over the stored vocabulary (sublinear tf, lowercase), L2 rows, projected on the SVD
        components, L2 rows again (zero rows stay zero): scikit-learn's TfidfVectorizer + TruncatedSVD."""
        column = self._vocabulary()
        idf = self.router.get_buffer("idf").double()
        x = torch.zeros(len(texts), len(idf), dtype=torch.float64, device=idf.device)  # (N, V)
        for row, text in enumerate(texts):
            counts = Counter(t for t in _TOKEN.findall(text.lower()) if t in column)
            for term, n in counts.items():
                x[row, column[term]] = 1.0 + math.log(n)
        x = x * idf
        x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)
        z = x @ self.router.get_buffer("components").double().T  # (N, dim)
        norms = z.norm(dim=1, keepdim=True)
        return (z / torch.where(norms > 0, norms, torch.ones_like(norms))).float()

    def _vocabulary(self) -> dict[str, int]:
        if not hasattr(self, "_columns"):
            self._columns = {t: i for i, t in enumerate(self.config.router["vocabulary"])}
        return self._columns

    @torch.no_grad()
    def _model_features(self, texts: list[str]) -> torch.Tensor:
        """The mean last hidden state of the featurizer model (`featurizer/`) over each text's first tokens."""
        if self._featurizer is None:
            from transformers import AutoModel, AutoTokenizer

            where = self.config.router["model"]
            tok = AutoTokenizer.from_pretrained(self.config.name_or_path, subfolder=where)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token or tok.unk_token
            model = AutoModel.from_pretrained(self.config.name_or_path, subfolder=where).to(self.device).eval()
            self._featurizer = (tok, model)
        tok, model = self._featurizer
        batch = [t if t else " " for t in texts]
        enc = tok(batch, truncation=True, max_length=self.config.router["max_tokens"], padding=True,
                  return_tensors="pt").to(self.device)
        hidden = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return ((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).float()

    def _path_costs(self, x: torch.Tensor) -> torch.Tensor:
        """(N, routed paths), lower is better (routing.router.Router.path_costs)."""
        buffers = dict(self.router.named_buffers())
        x = x.to(self.device, torch.float32)
        if "linear.weight" in buffers:
            return -(x @ buffers["linear.weight"].float().T + buffers["linear.bias"].float())
        cost = torch.zeros(len(x), *[1] * len(self.config.router["slices"]), device=x.device)
        for level, (lo, hi) in enumerate(self.config.router["slices"]):
            c = buffers[f"centroids.{level}"].float()  # (k, hi - lo)
            xs = x[:, lo:hi]
            d = ((xs**2).sum(1, keepdim=True) - 2 * xs @ c.T + (c**2).sum(1)).clamp_min(0)  # (N, k)
            shape = [len(x)] + [1] * len(self.config.router["slices"])
            shape[level + 1] = len(c)
            cost = cost + d.reshape(shape)
        cost = cost.reshape(len(x), -1)
        return cost + buffers["penalties"].float() if "penalties" in buffers else cost

    # ---- use ----
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits (B, T, V) of each sequence from its routed path; the mean token loss when `labels`."""
        rows = _unpadded(input_ids, attention_mask)
        paths = self.route(rows)
        self.last_paths = paths
        logits = None
        for path in sorted(set(paths)):
            index = [i for i, p in enumerate(paths) if p == path]
            mask = None if attention_mask is None else attention_mask[index]
            out = self.path_model(path)(input_ids=input_ids[index], attention_mask=mask).logits
            if logits is None:
                logits = out.new_zeros((len(input_ids), *out.shape[1:]))
            logits[index] = out
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                               labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 **kwargs) -> torch.Tensor:
        """Each sequence continued by its routed path (any `generate` option of a LlamaForCausalLM), the
        outputs (B, T') right-padded with the pad token; the paths are in `last_paths`."""
        if kwargs.get("return_dict_in_generate"):
            raise ValueError("DipacoMixtureForCausalLM.generate returns token ids only (return_dict_in_generate)")
        rows = _unpadded(input_ids, attention_mask)
        paths = self.route(rows)
        self.last_paths = paths
        outputs = []
        for row, path in zip(rows, paths):
            options = dict(kwargs)
            room = self.config.max_length - len(row)
            if options.get("max_new_tokens", room) > room:
                log.warning("paths see at most %d tokens; the prompt has %d, so at most %d are generated",
                            self.config.max_length, len(row), room)
                options["max_new_tokens"] = room
            outputs.append(self.path_model(path).generate(row[None], attention_mask=torch.ones_like(row[None]),
                                                          **options)[0])
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else self.config.eos_token_id
        width = max(len(o) for o in outputs)
        out = torch.full((len(outputs), width), pad if pad is not None else 0, dtype=torch.long, device=self.device)
        for i, o in enumerate(outputs):
            out[i, : len(o)] = o
        return out


def _unpadded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's tokens where the attention mask is 1 (left or right padding removed)."""
    if attention_mask is None:
        return list(input_ids)
    return [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
