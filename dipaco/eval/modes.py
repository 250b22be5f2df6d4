"""Routed evaluation modes: route once (`prefix`), re-route every W tokens (`every:W`), route by the
paths' own likelihood of the prefix (`likelihood`), the best path per sequence (`oracle`), chosen on
one half of its tokens to score the other (`oracle-split`) and every path on every path's documents (`all-paths`).

    dipaco eval --config configs/demo.yaml --run runs/demo --mode prefix --mode every:64 --mode oracle --mode oracle-split --best

Every mode scores the same tokens of each held-out document: those after the first
`routing.prefix_tokens` (the routing prefix), so the perplexities compare with each other and with
the dense baselines.

- `prefix`: the router picks one path from the text of the first P tokens; it scores tokens P.. .
- `every:W`: tokens P.. are cut in chunks [P, P+W), [P+W, P+2W), ...; chunk k is scored by the path
  the router picks from the text of the P tokens just before it (tokens [P + kW - P, P + kW)): the
  paper's frequent routing, where chunk i's text picks the path of chunk i+1, with the context the
  router was fit on (P tokens; chunk 0's is the prefix itself). The chosen path reads the whole text
  up to the chunk's end (a causal model: running it on the whole document and keeping that chunk's
  token losses is the same computation). W >= the sequence length is `prefix`.
- `likelihood`: every path reads the first P tokens; the document goes to the path that gives them the
  lowest loss, and that path scores tokens P.. (the paths themselves as the router, as Branch-Train-Merge
  weights its experts by the likelihood of the context; deployable: it sees only the prefix, at the cost
  of one P-token forward pass per path).
- `likelihood:K`: the same among the router's K best paths for the prefix (its K lowest costs): K prefix
  forward passes instead of one per path; `likelihood:1` is `prefix`, `likelihood:<paths>` is `likelihood`.
- `oracle`: every path scores every document; each document takes its lowest total loss. An upper
  bound on what any router that picks one path per sequence could do, in sample: the path is picked by
  the very tokens it then scores (a minimum over noisy estimates, more optimistic the more paths).
- `oracle-split`: the oracle out of sample: each document's scored tokens are split by position parity;
  the best path on the even half scores the odd half and the best on the odd half scores the even one
  (docs/evaluation.md says why parity). From the oracle's losses: no forward pass of its own.
- `all-paths`: perplexity of path p (rows) on the documents routed to path q (columns); a column is
  empty (null in eval.json) when no test document was routed to path q.

Per-token losses are computed once per (path, module round) in a `LossTable` and shared by the modes
and by `dipaco eval`'s headline row (the `prefix` mode at the last round); only one path model is in
memory at a time. Documents are routed by `dipaco.eval.prefix_routing.PrefixRouter`.

    table = LossTable(docs=docs, load=lambda p, r: load_path(p, r), score=partial(token_losses, batch_size=16, ...))
    modes = evaluate_modes(table, route=prefix_router, paths=prefix_router(docs), modes=["prefix", "every:64"],
                           rounds={p: last for p in evaluated}, best=None, n_paths=topology.n_paths, prefix=32)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dipaco.config import EVAL_MODES as MODES  # noqa: F401 - re-exported
from dipaco.config import parse_mode
from dipaco.eval.prefix_routing import RouteFn
from dipaco.eval.scoring import perplexity

log = logging.getLogger(__name__)


@dataclass
class LossTable:
    """Per-token losses of (path, round) on documents, computed on demand and kept.

    `load(path, round)` gives a path model; `score(model, docs)` gives `token_losses`."""

    docs: list[np.ndarray]
    load: Callable[[int, int], torch.nn.Module]
    score: Callable[[torch.nn.Module, list[np.ndarray]], list[np.ndarray]]

    def __post_init__(self) -> None:
        self._table: dict[tuple[int, int], dict[int, np.ndarray]] = {}

    def ensure(self, needs: dict[tuple[int, int], set[int]]) -> None:
        """Compute the missing losses for `{(path, round): {doc index}}`, one model at a time."""
        for key in sorted(needs):
            have = self._table.setdefault(key, {})
            todo = sorted(set(needs[key]) - set(have))
            if not todo:
                continue
            model = self.load(*key)
            for d, losses in zip(todo, self.score(model, [self.docs[d] for d in todo]), strict=True):
                have[d] = losses
            del model
            log.info("scored %d documents with path %d (modules of round %d)", len(todo), *key)

    def get(self, path: int, round: int, doc: int) -> np.ndarray:
        return self._table[(path, round)][doc]

    def has(self, path: int, round: int, doc: int) -> bool:
        """Whether the losses of `doc` under (`path`, `round`) are already computed."""
        return doc in self._table.get((path, round), {})


def chunk_spans(length: int, *, prefix: int, window: int) -> list[tuple[int, int]]:
    """The scored spans `[start, end)` of a document of `length` tokens: from `prefix` on, `window`
    tokens at a time (one span when `window` covers the document; none when nothing is scored)."""
    return [(s, min(s + window, length)) for s in range(prefix, length, window)]


def route_chunks(route: RouteFn, docs: list[np.ndarray], *,
                 prefix: int, window: int) -> list[list[tuple[int, int, int]]]:
    """Each document's spans with the path that scores them: `[(start, end, path)]`.

    `route(docs, n_tokens)` picks a path per document from the text of its first n tokens; a span
    starting at token s is routed from the `prefix` tokens before it, tokens [s - prefix, s) (the
    first span's are the routing prefix itself, so one span per document is the `prefix` mode)."""
    spans = [chunk_spans(len(d), prefix=prefix, window=window) for d in docs]
    flat = [(d, s, e) for d, doc_spans in enumerate(spans) for s, e in doc_spans]
    contexts = [docs[d][max(0, s - prefix):s] for d, s, _ in flat]
    paths = route(contexts, [len(c) for c in contexts]) if flat else np.zeros(0, np.int64)
    out: list[list[tuple[int, int, int]]] = [[] for _ in docs]
    for (d, s, e), p in zip(flat, paths, strict=True):
        out[d].append((s, e, int(p)))
    return out


def routed_scores(table: LossTable, routes: list[list[tuple[int, int, int]]], rounds: dict[int, int],
                  n_paths: int) -> dict:
    """Total loss and token count per document and per path for routed spans; `rounds[p]` is the
    module round path p is scored at. Returns `{"nll": (D,), "tokens": (D,), "path_nll": (P,),
    "path_tokens": (P,), "path_documents": (P,)}` (a document counts for the path of its first span)."""
    needs: dict[tuple[int, int], set[int]] = {}
    for d, spans in enumerate(routes):
        for _, _, p in spans:
            needs.setdefault((p, rounds[p]), set()).add(d)
    table.ensure(needs)
    nll, tokens = np.zeros(len(routes)), np.zeros(len(routes), dtype=np.int64)
    path_nll, path_tokens = np.zeros(n_paths), np.zeros(n_paths, dtype=np.int64)
    path_docs = np.zeros(n_paths, dtype=np.int64)
    for d, spans in enumerate(routes):
        if spans:
            path_docs[spans[0][2]] += 1
        for s, e, p in spans:
            loss = float(table.get(p, rounds[p], d)[s:e].sum())
            nll[d] += loss
            tokens[d] += e - s
            path_nll[p] += loss
            path_tokens[p] += e - s
    return {"nll": nll, "tokens": tokens, "path_nll": path_nll, "path_tokens": path_tokens, "path_documents": path_docs}


def oracle_scores(table: LossTable, n_docs: int, rounds: dict[int, int], *, prefix: int) -> dict:
    """Every path on every document; each document takes the path with its lowest total loss.
    Same keys as `routed_scores`, plus `"choice"` (D,) — the best path of each document."""
    paths = sorted(rounds)
    n_paths = max(paths) + 1
    table.ensure({(p, rounds[p]): set(range(n_docs)) for p in paths})
    totals = np.array([[float(table.get(p, rounds[p], d)[prefix:].sum()) for d in range(n_docs)]
                       for p in paths]).reshape(len(paths), n_docs)  # (P, D)
    choice = np.asarray(paths)[totals.argmin(axis=0)] if n_docs else np.zeros(0, dtype=np.int64)
    tokens = np.array([max(0, len(table.docs[d]) - prefix) for d in range(n_docs)], dtype=np.int64)
    nll = totals.min(axis=0) if n_docs else np.zeros(0)
    return {
        "nll": nll, "tokens": tokens, "choice": choice,
        "path_nll": np.bincount(choice, weights=nll, minlength=n_paths),
        "path_tokens": np.bincount(choice, weights=tokens, minlength=n_paths).astype(np.int64),
        "path_documents": np.bincount(choice, minlength=n_paths).astype(np.int64),
    }


def split_oracle_scores(table: LossTable, n_docs: int, rounds: dict[int, int], *, prefix: int) -> dict:
    """The oracle chosen out of sample (two-fold): each document's scored tokens (from `prefix` on) are
    cut into two halves by position, even and odd offsets from `prefix`; the path in `rounds` with the
    lowest total loss on one half scores the other half, so no token is scored by a path chosen on it,
    and every scored token is scored once, as in every mode. Ties (and an empty half) go to the lower
    path. The table entries are the oracle's: no forward pass of its own.

    Same keys as `routed_scores` (a document counts for the path that scores its first scored token),
    plus `"choice"` (D, 2): the path chosen on the even half (it scores the odd one) and on the odd half."""
    paths = sorted(rounds)
    n_paths = max(paths) + 1
    table.ensure({(p, rounds[p]): set(range(n_docs)) for p in paths})
    halves = np.zeros((len(paths), n_docs, 2))  # (P, D, 2): loss of the even / odd half
    for i, p in enumerate(paths):
        for d in range(n_docs):
            scored = table.get(p, rounds[p], d)[prefix:]
            halves[i, d] = scored[0::2].sum(), scored[1::2].sum()
    picked = halves.argmin(axis=0)  # (D, 2): index into `paths` of the best path on each half
    docs = np.arange(n_docs)
    scoring = picked[:, ::-1]  # (D, 2): the path scoring the even half was chosen on the odd one, and back
    nll_halves = halves[scoring, docs[:, None], [0, 1]]  # (D, 2)
    sizes = np.array([[(n + 1) // 2, n // 2] for n in (max(0, len(table.docs[d]) - prefix) for d in docs)],
                     dtype=np.int64).reshape(n_docs, 2)  # (D, 2): tokens of the even / odd half
    by = np.asarray(paths)[scoring]  # (D, 2): the path id scoring each half
    return {
        "nll": nll_halves.sum(axis=1), "tokens": sizes.sum(axis=1), "choice": np.asarray(paths)[picked],
        "path_nll": np.bincount(by.ravel(), weights=nll_halves.ravel(), minlength=n_paths),
        "path_tokens": np.bincount(by.ravel(), weights=sizes.ravel(), minlength=n_paths).astype(np.int64),
        "path_documents": np.bincount(by[sizes[:, 0] > 0, 0], minlength=n_paths).astype(np.int64),
    }


def likelihood_choice(table: LossTable, n_docs: int, rounds: dict[int, int], *, prefix: int,
                      candidates: np.ndarray | None = None) -> np.ndarray:
    """The `likelihood` mode's path (D,) of each document: the path in `rounds` whose model gives the
    document's first `prefix` tokens the lowest total loss (the first token has none; ties go to the
    lower path). Every path scores every document (as for `oracle`: the same table entries), or with
    `candidates` (D, K) (`likelihood:K`: the router's K best paths of each document) only those of its row
    that are in `rounds` (a row with none of them is refused)."""
    paths = sorted(rounds)
    if candidates is None:
        candidates = np.tile(np.asarray(paths, dtype=np.int64), (n_docs, 1))
    if len(candidates) != n_docs:
        raise ValueError(f"candidates must have a row per document ({n_docs}), got {len(candidates)}")
    allowed = np.isin(candidates, paths)
    if n_docs and not allowed.any(axis=1).all():
        d = int(np.flatnonzero(~allowed.any(axis=1))[0])
        raise ValueError(f"document {d}: none of its candidate paths {candidates[d].tolist()} was evaluated")
    table.ensure({(p, rounds[p]): set(np.flatnonzero((candidates == p).any(axis=1)).tolist()) for p in paths})
    choice = np.zeros(n_docs, dtype=np.int64)
    for d in range(n_docs):
        row = sorted({int(p) for p in candidates[d][allowed[d]]})
        losses = [float(table.get(p, rounds[p], d)[:prefix].sum()) for p in row]
        choice[d] = row[int(np.argmin(losses))]
    return choice


def all_paths_table(table: LossTable, routed: np.ndarray, rounds: dict[int, int], *, prefix: int) -> np.ndarray:
    """Perplexity (P, P) over the paths in `rounds` (sorted): row i = the i-th path's model, column j =
    the documents routed to the j-th path (NaN where no document was routed there)."""
    paths = sorted(rounds)
    table.ensure({(p, rounds[p]): set(range(len(routed))) for p in paths})
    out = np.full((len(paths), len(paths)), np.nan)
    for j, q in enumerate(paths):
        docs = np.flatnonzero(routed == q)
        count = sum(max(0, len(table.docs[d]) - prefix) for d in docs)
        if not count:
            continue
        for i, p in enumerate(paths):
            out[i, j] = perplexity(sum(float(table.get(p, rounds[p], d)[prefix:].sum()) for d in docs), count)
    return out


def column_tokens(docs: list[np.ndarray], routed: np.ndarray, paths: list[int], *, prefix: int) -> list[int]:
    """The tokens `all_paths_table` scores in each column: those after `prefix` of the documents routed
    to each of `paths` (0 for a path no test document was routed to)."""
    return [sum(max(0, len(docs[d]) - prefix) for d in np.flatnonzero(routed == q)) for q in paths]


def json_cells(grid: np.ndarray, tokens: list[int]) -> list[list[float | None]]:
    """`all_paths_table`'s grid for eval.json: null in the columns that scored no `tokens` (no test document
    was routed to that path), so a NaN left in the results is a broken number, never an empty path."""
    return [[float(x) if tokens[j] else None for j, x in enumerate(row)] for row in grid]


def prefix_routes(docs: list[np.ndarray], paths: np.ndarray, *, prefix: int) -> list[list[tuple[int, int, int]]]:
    """The `prefix` mode's spans: each document's tokens from `prefix` on, all scored by `paths[d]`, its
    path routed from the first `prefix` tokens (no span when nothing is left to score)."""
    return [[(s, e, int(p)) for s, e in chunk_spans(len(d), prefix=prefix, window=max(1, len(d)))]
            for d, p in zip(docs, paths, strict=True)]


def evaluate_modes(table: LossTable, *, route: RouteFn, paths: np.ndarray, modes: list[str], rounds: dict[int, int],
                   best: dict[int, int] | None, n_paths: int, prefix: int,
                   shortlist: Callable[[list[np.ndarray], int], np.ndarray] | None = None) -> dict:
    """Every requested mode with each evaluated path at `rounds[path]` (the last module version), and
    again at `best[path]` when `best` is given; `all-paths` only at `rounds`.

    `table` holds the test documents' losses (filled on demand, shared with the caller: what it has
    already scored is not scored again); `paths` (D,) is each document's path routed from its first
    `prefix` tokens (the `prefix` mode); `route` re-routes for `every:W`; `shortlist(docs, K)` (D, K) gives
    the router's K best paths for `likelihood:K`; `n_paths` sizes the per-path arrays. Returns the JSON-able
    `{"rows": [...], "all_paths": [[...]] | None, "best_rounds": {...} | None}`."""
    docs = table.docs
    parsed = [(mode, *parse_mode(mode)) for mode in modes]
    settings = [("last", rounds)]
    if best is not None:
        settings.append(("best", {p: int(best[p]) for p in rounds}))
    routes_of_prefix = prefix_routes(docs, paths, prefix=prefix)
    rows, all_paths = [], None
    for checkpoints, versions in settings:
        for mode, kind, window in parsed:
            if kind == "all-paths":
                if checkpoints == "last":
                    grid = all_paths_table(table, np.asarray(paths), versions, prefix=prefix)
                    tokens = column_tokens(docs, np.asarray(paths), sorted(versions), prefix=prefix)
                    all_paths = json_cells(grid, tokens)
                    empty = [q for q, n in zip(sorted(versions), tokens) if not n]
                    if empty:
                        log.warning("eval all-paths: no test document was routed to path(s) %s; their columns "
                                    "are empty (null in eval.json)", ", ".join(map(str, empty)))
                continue
            if kind == "oracle":
                scores = oracle_scores(table, len(docs), versions, prefix=prefix)
            elif kind == "oracle-split":
                scores = split_oracle_scores(table, len(docs), versions, prefix=prefix)
            elif kind == "likelihood":
                if window and shortlist is None:
                    raise ValueError(f"eval mode {mode!r} needs the router's shortlist of candidate paths")
                choice = likelihood_choice(table, len(docs), versions, prefix=prefix,
                                           candidates=shortlist(docs, window) if window else None)
                scores = routed_scores(table, prefix_routes(docs, choice, prefix=prefix), versions, n_paths)
            else:
                routes = (routes_of_prefix if kind == "prefix"
                          else route_chunks(route, docs, prefix=prefix, window=window))
                scores = routed_scores(table, routes, versions, n_paths)
            rows.append(mode_row(mode, checkpoints, scores, versions))
            log.info("eval %s (%s checkpoints): perplexity %.3f", mode, checkpoints, rows[-1]["perplexity"])
    return {"rows": rows, "all_paths": all_paths, "best_rounds": settings[1][1] if best is not None else None}


def mode_row(mode: str, checkpoints: str, scores: dict, rounds: dict[int, int]) -> dict:
    """One row of the mode table: the perplexity over all scored tokens, and per evaluated path."""
    per_path = [{"path": p, "round": rounds[p], "documents": int(scores["path_documents"][p]),
                 "tokens": int(scores["path_tokens"][p]),
                 "perplexity": perplexity(scores["path_nll"][p], scores["path_tokens"][p])
                 if scores["path_tokens"][p] else None} for p in sorted(rounds)]
    return {"mode": mode, "checkpoints": checkpoints, "tokens": int(scores["tokens"].sum()),
            "perplexity": perplexity(scores["nll"].sum(), scores["tokens"].sum()), "per_path": per_path}


def format_modes(modes: dict) -> str:
    """The eval-mode table (and the all-paths table) as text."""
    from dipaco.tables import format_table

    rows = [[r["mode"], r["checkpoints"], f"{r['tokens']:,}", f"{r['perplexity']:.3f}"] for r in modes["rows"]]
    text = "Eval modes\n" + format_table(["mode", "checkpoints", "tokens", "perplexity"], rows)
    if modes.get("best_rounds"):
        text += "\nbest round per path: " + ", ".join(f"{p}: {r}" for p, r in modes["best_rounds"].items())
    if modes.get("all_paths"):
        table = modes["all_paths"]
        cells = [[f"path {p}"] + [("-" if x is None or np.isnan(x) else f"{x:.2f}") for x in row]
                 for p, row in enumerate(table)]
        text += ("\n\nAll paths (rows: the model of path p; columns: documents routed to path q)\n"
                 + format_table(["model"] + [f"docs of {q}" for q in range(len(table))], cells))
    return text
