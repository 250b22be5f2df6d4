"""The large corpus (`make corpus-large`) against the bundled one: documents, characters, bytes, tokens,
and the 8x8 and 16x16 grids' smallest path shards against what a path trains on.

    python bench/bench_corpus_size.py        # after make corpus-large; about 15 min on one busy core

Tokens: each corpus's own byte-level BPE of `sharding.vocab_size` (4,096) tokens, trained as a run trains it
(`sharding.tokenizer.train_tokenizer`) but on a seeded sample of `--bpe-docs` documents; every document of
the bundled corpus and a seeded sample of `--sample` documents of the large one (scaled up) are then
encoded, plus one EOS token each (the shards end every document with one). Training tokens: those
of the train split (`routing.corpus.assign_splits`, the test fraction of configs/demo.yaml and large.yaml).

Shards: routing the corpus as the recipe does (features of a trained warm start) needs a warm start
of each corpus, which one core cannot afford here; so every training document is routed by k-means on
the TF-IDF features of its 32-token prefix instead (`routing.featurizer: tfidf`, flat k-means, nearest
centroid: the recipe's routing with another featurizer), fitted on `--fit-docs` sampled training
prefixes. The bundled corpus's 8x8 row calibrates it against bench/results/grid-scaling.json (the same
grid routed on the warm start's features). A path trains on `tokens_min x epochs_max` of that file's 8x8
row (its steps x batch x sequence length).

Writes bench/results/corpus-size.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import markdown_table, write_results  # noqa: E402

log = logging.getLogger("bench_corpus_size")
LARGE = ROOT / "data" / "large" / "large_corpus.jsonl.zst"
GRIDS = (((8, 8), 0.0), ((16, 16), 0.0), ((16, 16), 1.5))  # (levels, routing.balance: 0 = nearest centroid)


def read_corpus(path: Path) -> tuple[list[str], int]:
    """The documents' texts and the JSON lines' size in bytes."""
    import zstandard

    texts, size = [], 0
    with open(path, "rb") as f:
        for line in zstandard.ZstdDecompressor().stream_reader(f).read().splitlines():
            size += len(line) + 1
            texts.append(json.loads(line)["text"])
    return texts, size


def count_tokens(texts: list[str], *, bpe_docs: int, seed: int) -> tuple[object, np.ndarray]:
    """The corpus's own BPE (trained on a seeded sample) and every document's token count, EOS included."""
    from sharding.tokenizer import train_tokenizer

    rng = np.random.default_rng(seed)
    sample = [texts[i] for i in sorted(rng.choice(len(texts), size=min(bpe_docs, len(texts)), replace=False))]
    tok = train_tokenizer(sample, vocab_size=4096, out_dir=tempfile.mkdtemp(prefix="corpus-size-bpe-"))
    backend = tok.backend_tokenizer
    counts = np.empty(len(texts), dtype=np.int64)
    for start in range(0, len(texts), 4096):
        batch = backend.encode_batch(texts[start : start + 4096], add_special_tokens=False)
        counts[start : start + len(batch)] = [len(e.ids) + 1 for e in batch]
    return tok, counts


def shard_tokens(prefixes: list[str], tokens: np.ndarray, *, levels: tuple[int, int], balance: float,
                 fit_docs: int, seed: int) -> np.ndarray:
    """Training tokens of each path of a `levels` grid, the training documents (their 32-token `prefixes`
    and `tokens`) routed by TF-IDF k-means: to the nearest centroid, or with `balance` > 0 by the capacity
    assignment that keeps the largest / smallest path within that ratio (`routing.balance`)."""
    from routing import RoutingConfig
    from routing.router import Router

    rng = np.random.default_rng(seed)
    fit = sorted(rng.choice(len(prefixes), size=min(fit_docs, len(prefixes)), replace=False))
    config = RoutingConfig(featurizer="tfidf", balance=balance, seed=seed)
    router, _ = Router.fit([prefixes[i] for i in fit], levels=list(levels), config=config)
    features = np.concatenate([router.features(prefixes[s : s + 65536]) for s in range(0, len(prefixes), 65536)])
    paths = router.assign_train(features)[:, 0] if balance else router.assign(features)
    return np.bincount(paths, weights=tokens, minlength=router.n_paths).astype(np.int64)


def measure(name: str, path: Path, *, test_fraction: float, sample: int, args) -> dict:
    """Sizes, tokens and the grids' shard sizes of one corpus; tokens and shards from a seeded sample of
    `sample` documents scaled up to the whole corpus where it holds more (0 = every document)."""
    from routing.corpus import TRAIN, assign_splits
    from sharding.tokenizer import prefix_texts

    started = time.perf_counter()
    texts, jsonl_bytes = read_corpus(path)
    split = assign_splits(len(texts), test_fraction=test_fraction, seed=0)
    row = {"corpus": name, "path": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
           "documents": len(texts), "characters": sum(map(len, texts)), "jsonl_bytes": jsonl_bytes,
           "compressed_bytes": path.stat().st_size, "test_fraction": test_fraction, "grids": {}}
    if 0 < sample < len(texts):
        keep = np.sort(np.random.default_rng(args.seed).choice(len(texts), size=sample, replace=False))
        texts, split = [texts[i] for i in keep], split[keep]
    scale = row["documents"] / len(texts)
    tok, tokens = count_tokens(texts, bpe_docs=args.bpe_docs, seed=args.seed)
    train = np.flatnonzero(split == TRAIN)
    row.update({"sampled_documents": len(texts), "scale": scale, "tokens": round(int(tokens.sum()) * scale),
                "training_tokens": round(int(tokens[train].sum()) * scale),
                "token_seconds": round(time.perf_counter() - started, 1)})
    counted = time.perf_counter()
    prefixes = prefix_texts(tok, [texts[i] for i in train], n_tokens=32)
    row["prefix_seconds"] = round(time.perf_counter() - counted, 1)
    for levels, balance in GRIDS:
        t0 = time.perf_counter()
        sizes = shard_tokens(prefixes, tokens[train], levels=levels, balance=balance, fit_docs=args.fit_docs,
                             seed=args.seed) * scale
        key = f"{levels[0]}x{levels[1]}" + (f" balance {balance}" if balance else "")
        row["grids"][key] = {
            "paths": len(sizes), "tokens_min": round(sizes.min()), "tokens_median": float(np.median(sizes)),
            "tokens_max": round(sizes.max()), "empty_paths": int((sizes == 0).sum()),
            "seconds": round(time.perf_counter() - t0, 1)}
        log.info("%s %s: %s", name, key, row["grids"][key])
    return row


def test_fraction(config: str) -> float:
    """corpus.test_fraction of configs/<config>.yaml."""
    import yaml

    return float(yaml.safe_load((ROOT / "configs" / f"{config}.yaml").read_text())["corpus"]["test_fraction"])


def path_tokens() -> tuple[int, dict]:
    """Tokens a path trains on, and the bundled corpus's 8x8 row routed on the warm start's features, from
    bench/results/grid-scaling.json (seed 0)."""
    grid = json.loads((ROOT / "bench" / "results" / "grid-scaling.json").read_text())
    (row,) = [r for r in grid["rows"] if r["model"] == "DiPaCo 8x8"]
    shards = row["per_seed"]["0"]["shards"]
    return round(shards["tokens_min"] * shards["epochs_max"]), shards


def estimate(rows: list[dict], warm: dict) -> int:
    """The large corpus's smallest 16x16 shard under the recipe's routing, scaled from TF-IDF by the bundled
    corpus's 8x8 ratio of warm-start to TF-IDF smallest shards."""
    bundled, large = rows
    return round(large["grids"]["16x16"]["tokens_min"] * warm["tokens_min"] / bundled["grids"]["8x8"]["tokens_min"])


def markdown(rows: list[dict], per_path: int, warm: dict, seconds: float, manifest: dict) -> str:
    bundled, large = rows
    ratio = {k: large[k] / bundled[k] for k in ("documents", "characters", "jsonl_bytes", "compressed_bytes",
                                                  "tokens", "training_tokens")}
    sizes = [[r["corpus"], f"{r['documents']:,}", f"{r['characters']:,}", f"{r['jsonl_bytes']:,}",
              f"{r['compressed_bytes']:,}", f"{r['tokens']:,}", f"{r['characters'] / r['tokens']:.2f}",
              f"{r['training_tokens']:,} ({r['test_fraction']} held out)"] for r in rows]
    sizes.append(["large / bundled", *(f"{ratio[k]:.1f}x" for k in ("documents", "characters", "jsonl_bytes",
                                                                      "compressed_bytes", "tokens")),
                  "", f"{ratio['training_tokens']:.1f}x"])
    shards = [[r["corpus"], grid, g["paths"], f"{g['tokens_min']:,}", f"{g['tokens_median']:,.0f}",
               f"{g['tokens_max']:,}", g["empty_paths"], f"{g['tokens_min'] / per_path:.2f}",
               f"{g['tokens_median'] / per_path:.2f}"] for r in rows for grid, g in r["grids"].items()]
    return f"""# The large corpus against the bundled one (bench/bench_corpus_size.py)

Each corpus's own 4,096-token byte-level BPE (trained on a seeded sample of documents); every document of the bundled
corpus encoded, and a seeded uniform sample of {large['sampled_documents']:,} documents of the large one (tokens and shards
scaled up by {large['scale']:.2f}); one EOS token per document. Took {seconds:.0f} s. `make corpus-large` built the large
corpus in {manifest['build_seconds']:,} s on loaded cores at `nice -n 10` (its manifest), JSON lines sha256 `{manifest['jsonl_sha256']}`.

{markdown_table(["corpus", "documents", "characters", "JSON lines bytes", "compressed bytes", "tokens",
                 "characters / token", "training tokens"], sizes)}

Path shards: training documents routed by flat k-means on the TF-IDF features of their 32-token prefix (not the
recipe's warm-start features: no warm start is trained here), fitted on a sample; to the nearest centroid as the
recipe routes, or balanced (`routing.balance: 1.5`, largest / smallest path within 1.5x). A path trains on {per_path:,}
tokens (bench/results/grid-scaling.json: the 8x8 grid's smallest shard x its epochs, 100 steps); the bundled corpus's
8x8 grid routed on the warm start's features (seed 0 there) had shards of {warm['tokens_min']:,} / {warm['tokens_median']:,.0f} /
{warm['tokens_max']:,} tokens (min / median / max).

{markdown_table(["corpus", "grid", "paths", "smallest shard (tokens)", "median", "largest", "empty paths",
                 "smallest / a path's training tokens", "median / a path's training tokens"], shards)}

Estimate for the recipe's routing (warm-start features, nearest centroid) of the large corpus at 16x16: its smallest
TF-IDF shard times the bundled corpus's 8x8 smallest shard on warm-start features over that on TF-IDF
({warm['tokens_min']:,} / {bundled['grids']['8x8']['tokens_min']:,}), i.e. assuming the warm start's features balance
the paths better than TF-IDF by the same factor: {estimate(rows, warm):,} tokens, {estimate(rows, warm) / per_path:.2f}x a
path's training tokens.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", type=Path, default=LARGE, help="the large corpus (make corpus-large)")
    parser.add_argument("--bpe-docs", type=int, default=20_000, help="documents the BPE of each corpus is trained on")
    parser.add_argument("--fit-docs", type=int, default=50_000, help="training prefixes the router is fitted on")
    parser.add_argument("--sample", type=int, default=100_000,
                        help="documents of the large corpus tokenized and routed (scaled up to all; 0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="corpus-size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers' threads: one core
    from dipaco.data import demo_corpus_path

    started = time.perf_counter()
    rows = [measure("bundled (demo)", demo_corpus_path(), test_fraction=test_fraction("demo"), sample=0, args=args),
            measure("large", args.large, test_fraction=test_fraction("large"), sample=args.sample, args=args)]
    per_path, warm = path_tokens()
    seconds = time.perf_counter() - started
    manifest = json.loads(args.large.with_name("large_corpus.manifest.json").read_text())
    manifest = {k: manifest[k] for k in ("jsonl_sha256", "compressed_sha256", "recipe", "build_seconds", "counts")}
    results = {"rows": rows, "path_training_tokens": per_path, "bundled_8x8_warm_start_shards": warm,
               "large_16x16_smallest_shard_estimate": estimate(rows, warm),
               "large_manifest": manifest, "seconds": round(seconds, 1)}
    write_results(args.name, results, markdown(rows, per_path, warm, seconds, manifest))


if __name__ == "__main__":
    main()
