"""An exported mixture as an lm-evaluation-harness model type, `dipaco`: each request routed by its own
context to one path, requests batched by path, scored by the project's one scorer.

    python -m dipaco.inference.harness --model dipaco --model_args path=out/demo,route=likelihood \
        --tasks dipaco_demo --include_path dipaco/data/lm_eval       # = lm_eval with `dipaco` registered
    dipaco-lm-eval ...                                               # the same, as a console script
    make lm-eval RUN=runs/demo                                       # the mixture and the dense baselines

lm-evaluation-harness (0.4.x) finds models by importing them, so `dipaco` is registered by importing this
module: the entry points above do that and then run lm_eval's own command line; `lm_eval.simple_evaluate
(model=MixtureLM(path=...), ...)` works from Python. `path` is a mixture directory (`dipaco export`) or
any one Hugging Face model directory such as an exported dense baseline (`SingleModel`: no routing, the
same tokenization and scoring, for a side-by-side comparison).

- `loglikelihood`: the context and the continuation are tokenized as the harness's own causal models do
  (whole text, then split after the context's tokens; the context's trailing spaces go with the
  continuation; an empty context is the EOS token); the request goes to the path its context routes
  to (its first `prefix_tokens` tokens); the path reads at most `max_length` tokens, the last ones.
- `loglikelihood_rolling`: the harness's disjoint rolling windows of `max_length` tokens, the first one
  after EOS; a text is routed by its own first `prefix_tokens` tokens, so those tokens are scored by the
  path they chose (`dipaco eval` leaves them out of every score for that reason).
- `generate_until`: routed by the context, continued by `dipaco generate`'s own function (greedy unless
  `temperature` > 0), cut at the first stop string; a context longer than the path can read keeps its
  last tokens.

A context of fewer than 2 tokens gives likelihood routing nothing to compare: every path ties, and the
tie goes to the lowest path, as in the `likelihood` eval mode.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from dipaco.device import resolve_device
from dipaco.eval.scoring import token_losses_and_greedy
from dipaco.inference.continuation import continue_tokens
from dipaco.inference.manifest import MANIFEST
from dipaco.inference.mixture import Mixture
from dipaco.inference.single_model import SingleModel

log = logging.getLogger(__name__)

DEFAULT_BATCH = 16
DEFAULT_MAX_GEN_TOKS = 256


MODEL_OPTIONS = ("path", "route", "max_loaded", "batch_size", "device", "max_batch_size")


def refuse_unknown_options(unknown: dict) -> None:
    """A `--model_args` option the `dipaco` model does not take (a typo such as `rout=likelihood`) is an error
    naming it and the nearest option, never ignored."""
    if not unknown:
        return
    import difflib

    name = sorted(unknown)[0]
    near = difflib.get_close_matches(name, MODEL_OPTIONS, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else ""
    raise ValueError(f"dipaco model: unknown option {name}={unknown[name]!r} in --model_args{hint} (the options "
                     f"are {', '.join(MODEL_OPTIONS)})")


@register_model("dipaco")
class MixtureLM(LM):
    """lm-evaluation-harness model `dipaco`: `--model_args path=DIR[,route=router|likelihood|likelihood:K][,max_loaded=N]`."""

    def __init__(self, path: str, route: str | None = None, max_loaded: int | None = None,
                 batch_size: int | str = DEFAULT_BATCH, device: str | None = None,
                 max_batch_size: int | None = None, **unknown):
        super().__init__()
        refuse_unknown_options(unknown)
        if max_batch_size is not None:
            log.debug("dipaco model: max_batch_size %s unused (batch_size is fixed)", max_batch_size)
        directory = Path(str(path))
        device = harness_device(device)
        if (directory / MANIFEST).is_file():
            self.mixture = Mixture(directory, route=route, max_loaded=max_loaded, device=device)
        else:
            if route is not None:
                raise ValueError(f"route={route!r}: {directory} is one model, not a mixture; nothing is routed")
            self.mixture = SingleModel(directory, device=device)
        self.batch_size = DEFAULT_BATCH if str(batch_size).startswith("auto") else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._device = device

    @property
    def eot_token_id(self) -> int:
        return int(self.mixture.tokenizer.eos_token_id)

    @property
    def tokenizer_name(self) -> str:
        return str(self.mixture.directory)

    def tok_encode(self, text: str) -> list[int]:
        (ids,) = self.mixture.encode([text])
        return ids.tolist()

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The context's and the continuation's tokens, split as the harness's causal models split them."""
        if not context:
            return [self.eot_token_id], self.tok_encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.tok_encode(context + continuation), self.tok_encode(context)
        return head, whole[len(head):]

    def route(self, contexts: list[list[int]]) -> np.ndarray:
        """The path (N,) of each tokenized context; contexts too short to route go to the lowest path."""
        paths = np.full(len(contexts), self.mixture.path_ids[0], dtype=np.int64)
        routable = [i for i, c in enumerate(contexts) if not self.mixture.route.startswith("likelihood") or len(c) >= 2]
        if routable:
            paths[routable] = self.mixture.route_tokens([np.asarray(contexts[i], dtype=np.int64) for i in routable])
        return paths

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*request.args) for request in requests]
        paths = self.route([context for context, _ in pairs])
        limit = self.mixture.max_length
        for _, continuation in pairs:
            if len(continuation) >= limit:
                raise ValueError(f"a continuation of {len(continuation)} tokens: the dipaco model scores at most "
                                 f"{limit - 1} tokens after some context (max_length {limit})")
        sequences = [np.asarray(context + continuation, dtype=np.int64)[-limit:] for context, continuation in pairs]
        losses, greedy = self._score(sequences, paths)
        out = []
        for (_, continuation), loss, best in zip(pairs, losses, greedy, strict=True):
            n = len(continuation)
            out.append((-float(loss[-n:].sum()), bool(best[-n:].all())) if n else (0.0, True))
        return self._cached("loglikelihood", requests, out)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [self.tok_encode(request.args[0]) for request in requests]
        paths = self.route(texts)
        windows, owners = [], []
        for d, tokens in enumerate(texts):
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    tokens, prefix_token=self.eot_token_id, max_seq_len=self.mixture.max_length - 1, context_len=1)):
                windows.append((np.asarray(context + predicted, dtype=np.int64), len(predicted)))
                owners.append(d)
        losses, _ = self._score([w for w, _ in windows], paths[owners] if owners else paths[:0])
        totals = np.zeros(len(texts))
        for d, (_, n), loss in zip(owners, windows, losses, strict=True):
            totals[d] -= loss[-n:].sum()
        return self._cached("loglikelihood_rolling", requests, [float(t) for t in totals])

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        contexts = [self.tok_encode(request.args[0]) for request in requests]
        paths = self.route(contexts)
        out = []
        for request, context, path in zip(requests, contexts, paths, strict=True):
            kwargs = dict(request.args[1]) if len(request.args) > 1 and request.args[1] else {}
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = float(kwargs.pop("temperature", 0.0))
            if not kwargs.pop("do_sample", temperature > 0):
                temperature = 0.0
            limit = self.mixture.max_length
            keep = limit - min(max_new, limit // 2)
            prompt = np.asarray(context[-keep:] or [self.eot_token_id], dtype=np.int64)
            new = continue_tokens(self.mixture.model(int(path)), prompt, max_length=limit, max_new_tokens=max_new,
                                  temperature=temperature, seed=int(kwargs.pop("seed", 0)),
                                  pad_id=self.mixture.tokenizer.pad_token_id, eos_id=self.eot_token_id)
            text = self.mixture.tokenizer.decode(new.tolist(), skip_special_tokens=True)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return self._cached("generate_until", requests, out)

    def _score(self, sequences: list[np.ndarray], paths: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-token losses and greedy flags of each sequence under its path: one path's sequences at a time."""
        losses: list[np.ndarray] = [np.zeros(0)] * len(sequences)
        greedy: list[np.ndarray] = [np.zeros(0, dtype=bool)] * len(sequences)
        by_path: dict[int, list[int]] = defaultdict(list)
        for i, path in enumerate(paths):
            by_path[int(path)].append(i)
        for path, index in sorted(by_path.items()):
            scored, best = token_losses_and_greedy(self.mixture.model(path), [sequences[i] for i in index],
                                                   batch_size=self.batch_size, device=self._device, precision="fp32")
            for i, loss, flags in zip(index, scored, best, strict=True):
                losses[i], greedy[i] = loss, flags
            log.debug("scored %d sequences with path %d", len(index), path)
        return losses, greedy

    def _cached(self, kind: str, requests, results: list) -> list:
        for request, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial(kind, request.args, result)
        return results


def harness_device(name: str | None) -> torch.device:
    """The device for lm_eval's `--device` (its default is cuda:0): CUDA where there is a GPU, else the CPU
    with a warning, as the harness's own `hf` model does; None picks CUDA when present."""
    if name is None:
        return resolve_device("auto")
    if name.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s was asked for, but torch sees no CUDA device: running on the CPU", name)
        return torch.device("cpu")
    return torch.device(name)


def main() -> None:
    """lm_eval's command line with the `dipaco` model type registered (`python -m dipaco.inference.harness`)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
