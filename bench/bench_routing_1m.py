"""Routing a million documents with bounded memory: featurize, fit on a sample, assign, streamed in batches.

    python bench/bench_routing_1m.py                        # 1,000,000 documents (or what --max-seconds allows)
    python bench/bench_routing_1m.py --docs 200000 --max-seconds 300

The documents are the bundled corpus (~14k documents) repeated with seeded perturbations, generated
one batch at a time and never all in memory: repetition r of document i keeps its first 2,000
characters (routing reads only a prefix of `routing.prefix_tokens` tokens), shuffles its sentences
and drops 10% of its words (seed (r, i)); repetition 0 is the corpus itself. Per batch of `--batch`
documents: the prefix of `--prefix-tokens` tokens (a 4096-token BPE trained on 3,000 corpus
documents, `sharding.tokenizer.prefix_texts`), the configured featurizer (`tfidf`: TF-IDF -> SVD ->
L2, `routing.embed`), then the assignment to the 16x16 grid's 256 paths (`Router.assign`: product
k-means, faiss nearest centroid per level). The router is fitted once, on the first `--fit-sample`
documents of the stream (featurizer + faiss k-means, `Router.fit`), as `routing.fit_sample` does in
`dipaco route`. Only the path ids (8 bytes a document) and the path sizes are kept.

Reported: documents per second of each stage (prefix, featurize, assign; the perturbation that makes
the documents is timed apart and not counted), the fit's seconds, the process's peak resident memory
(VmHWM) and its resident memory after every 10% of the documents (flat = bounded), the path sizes. The
`base-model` featurizer (a demo-size path model, hidden 128, 4 blocks, random weights: throughput does
not depend on them) is timed on a sample of `--base-sample` prefixes only and extrapolated to the
whole run: on these CPUs it would take hours. When the stream has not reached `--docs` after
`--max-seconds`, it stops there and the time for `--docs` is extrapolated from the measured rates,
labelled as such.

Writes bench/results/routing-1m.json and bench/results/routing-1m.md, with the machine.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import markdown_table, write_results  # noqa: E402

log = logging.getLogger("bench_routing_1m")
MIB = 2**20
KEEP_CHARS = 2000
SENTENCE = re.compile(r"(?<=[.!?])\s+")


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def base_corpus() -> list[str]:
    """The bundled corpus's texts (~23 MB: the source of every repetition, the same whatever --docs)."""
    import zstandard

    from dipaco.data import demo_corpus_path

    with open(demo_corpus_path(), "rb") as raw:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        return [text for line in reader if (text := json.loads(line).get("text", "").strip())]


def perturb(text: str, *, rng: np.random.Generator) -> str:
    """The text's first KEEP_CHARS characters with its sentences shuffled and 10% of its words dropped."""
    sentences = SENTENCE.split(text[:KEEP_CHARS])
    rng.shuffle(sentences)
    words = " ".join(sentences).split(" ")
    keep = rng.random(len(words)) >= 0.1
    return " ".join(w for w, k in zip(words, keep) if k) or text[:KEEP_CHARS]


def documents(corpus: list[str], n: int, *, batch: int, seed: int, start: int = 0) -> Iterator[list[str]]:
    """Documents `start`..`n` in batches of `batch`: the corpus, then seeded perturbed repetitions of it."""
    for begin in range(start, n, batch):
        out = []
        for j in range(begin, min(n, begin + batch)):
            rep, i = divmod(j, len(corpus))
            out.append(corpus[i] if rep == 0 else perturb(corpus[i], rng=np.random.default_rng([seed, rep, i])))
        yield out


def compare_prefix_cuts(tok, texts: list[str], *, prefix_tokens: int, repeats: int = 2) -> dict:
    """docs/s of `prefix_texts` with its first cut at 32 characters per token (before) and at the
    library's default, side by side on the same perturbed batch, alternated `repeats` times (best of each)."""
    import sharding.tokenizer as st

    default = st._CHARS_PER_TOKEN
    best = {32: 0.0, default: 0.0}
    outputs = {}
    try:
        for _ in range(repeats):
            for cut in best:
                st._CHARS_PER_TOKEN = cut
                started = time.perf_counter()
                outputs[cut] = st.prefix_texts(tok, texts, n_tokens=prefix_tokens)
                best[cut] = max(best[cut], len(texts) / (time.perf_counter() - started))
    finally:
        st._CHARS_PER_TOKEN = default
    if outputs[32] != outputs[default]:
        raise RuntimeError("prefix_texts gave different prefixes with a different first cut")
    return {"documents": len(texts), "chars_per_token_before": 32, "chars_per_token_after": default,
            "docs_per_second_before": best[32], "docs_per_second_after": best[default],
            "speedup": best[default] / best[32]}


def base_model_rate(tok, prefixes: list[str], *, prefix_tokens: int) -> float:
    """Documents per second of the base-model featurizer (a demo-size path model) on `prefixes`."""
    import torch

    from dipaco.config import ModelConfig
    from dipaco.model.path_model import build_path_model
    from routing.embed_hf import HFFeaturizer

    base = Path(tempfile.mkdtemp(prefix="bench-base-"))
    try:
        model = build_path_model(ModelConfig(hidden_size=128, n_layers=4, n_heads=4), vocab_size=len(tok), seq_len=256,
                                 seed=0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
        model.save_pretrained(str(base))
        tok.save_pretrained(str(base))
        featurizer = HFFeaturizer(model_dir=str(base), max_tokens=prefix_tokens, batch_size=64)
        featurizer.transform(prefixes[:64])  # warm-up
        started = time.perf_counter()
        with torch.inference_mode():
            featurizer.transform(prefixes)
        return len(prefixes) / (time.perf_counter() - started)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--fit-sample", type=int, default=50_000)
    parser.add_argument("--levels", default="16x16")
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--base-sample", type=int, default=1024)
    parser.add_argument("--max-seconds", type=float, default=720.0, help="stop streaming after this long")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="routing-1m")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import faiss
    import torch

    from routing import RoutingConfig
    from routing.router import Router
    from sharding.tokenizer import prefix_texts, train_tokenizer

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    levels = [int(n) for n in args.levels.split("x")]
    began = time.perf_counter()
    corpus = base_corpus()
    tok_dir = tempfile.mkdtemp(prefix="bench-tok-")
    tok = train_tokenizer(corpus[:3000], vocab_size=4096, out_dir=tok_dir)
    setup_rss = _kib("VmRSS")
    log.info("corpus %d documents, tokenizer trained; RSS %.0f MiB", len(corpus), setup_rss / 1024)

    # fit on a sample: the first fit_sample documents of the stream
    started = time.perf_counter()
    sample = [d for batch in documents(corpus, args.fit_sample, batch=args.batch, seed=args.seed) for d in batch]
    sample_prefixes = prefix_texts(tok, sample, n_tokens=args.prefix_tokens)
    prepared = time.perf_counter()
    config = RoutingConfig(featurizer="tfidf", method="product", svd_dim=64, kmeans_iters=20, prefix_tokens=args.prefix_tokens,
                           seed=args.seed)
    router, fit_stats = Router.fit(sample_prefixes, levels=levels, config=config)
    fit_seconds = time.perf_counter() - prepared
    log.info("fit on %d documents in %.1fs (k-means %s)", len(sample), fit_seconds, fit_stats["kmeans"])
    base_rate = base_model_rate(tok, sample_prefixes[: args.base_sample], prefix_tokens=args.prefix_tokens)
    log.info("base-model featurizer: %.0f docs/s on %d prefixes", base_rate, args.base_sample)
    # before/after of the prefix step's first cut, side by side on the first batch of perturbed documents
    first_perturbed = next(documents(corpus, len(corpus) + args.batch, batch=args.batch, seed=args.seed,
                                     start=len(corpus)))
    prefix_compare = compare_prefix_cuts(tok, first_perturbed, prefix_tokens=args.prefix_tokens)
    log.info("prefix_texts first cut: %s", prefix_compare)
    del sample, sample_prefixes, first_perturbed
    sample_seconds = prepared - started

    # stream: prefix -> featurize -> assign, one batch at a time
    Path("/proc/self/clear_refs").write_text("5")  # the streaming's own peak from here on
    stream_rss = _kib("VmRSS")
    seconds = {"make": 0.0, "prefix": 0.0, "featurize": 0.0, "assign": 0.0}
    paths = np.empty(args.docs, dtype=np.int64)
    done, checkpoints, next_mark = 0, [], args.docs // 10
    stream_started = time.perf_counter()
    batches = documents(corpus, args.docs, batch=args.batch, seed=args.seed)
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        t1 = time.perf_counter()
        prefixes = prefix_texts(tok, batch, n_tokens=args.prefix_tokens)
        t2 = time.perf_counter()
        features = router.features(prefixes)
        t3 = time.perf_counter()
        paths[done : done + len(batch)] = router.assign(features)
        t4 = time.perf_counter()
        for key, a, b in (("make", t0, t1), ("prefix", t1, t2), ("featurize", t2, t3), ("assign", t3, t4)):
            seconds[key] += b - a
        done += len(batch)
        if done >= next_mark or done == args.docs:
            checkpoints.append({"documents": done, "rss_mib": _kib("VmRSS") / 1024, "peak_rss_mib": _kib("VmHWM") / 1024,
                                "seconds": time.perf_counter() - stream_started})
            log.info("%d documents, RSS %.0f MiB, %.0f docs/s (prefix+featurize+assign)", done,
                     checkpoints[-1]["rss_mib"], done / (seconds["prefix"] + seconds["featurize"] + seconds["assign"]))
            next_mark += args.docs // 10
        if time.perf_counter() - stream_started > args.max_seconds:
            log.warning("stopped after %.0fs at %d documents (--max-seconds)", args.max_seconds, done)
            break
    stream_peak = _kib("VmHWM")
    sizes = np.bincount(paths[:done], minlength=router.n_paths)
    rates = {k: done / v for k, v in seconds.items() if v > 0}
    routing_seconds = seconds["prefix"] + seconds["featurize"] + seconds["assign"]
    per_doc = routing_seconds / done
    results = {
        "settings": vars(args), "documents": done, "reached": done == args.docs, "levels": levels,
        "corpus_documents": len(corpus), "fit": {"documents": args.fit_sample, "seconds": fit_seconds,
                                                 "sample_prefix_seconds": sample_seconds, "kmeans": fit_stats["kmeans"],
                                                 "featurizer": fit_stats["featurizer"]},
        "seconds": seconds, "docs_per_second": rates, "prefix_first_cut": prefix_compare,
        "routing_docs_per_second": done / routing_seconds,
        "extrapolated_seconds_for_docs": per_doc * args.docs,
        "base_model": {"sample": args.base_sample, "docs_per_second": base_rate,
                       "extrapolated_hours_for_docs": args.docs / base_rate / 3600},
        "memory": {"setup_rss_mib": setup_rss / 1024, "stream_start_rss_mib": stream_rss / 1024,
                   "stream_peak_rss_mib": stream_peak / 1024, "checkpoints": checkpoints,
                   "paths_array_mib": paths.nbytes / MIB},
        "path_sizes": {"min": int(sizes.min()), "max": int(sizes.max()), "empty": int((sizes == 0).sum()),
                       "median": float(np.median(sizes))},
        "total_seconds": time.perf_counter() - began,
    }
    shutil.rmtree(tok_dir, ignore_errors=True)
    reached = f"{done:,} documents" + ("" if done == args.docs else f" of {args.docs:,} (stopped by --max-seconds)")
    rows = [[stage, f"{seconds[stage]:.1f}", f"{rates.get(stage, 0):,.0f}",
             f"{seconds[stage] / done * args.docs:,.0f}" + ("" if done == args.docs else " (extrapolated)")]
            for stage in ("prefix", "featurize", "assign")]
    rows.append(["routing (prefix + featurize + assign)", f"{routing_seconds:.1f}", f"{done / routing_seconds:,.0f}",
                 f"{per_doc * args.docs:,.0f}" + ("" if done == args.docs else " (extrapolated)")])
    rows.append([f"fit on a sample of {args.fit_sample:,} (TF-IDF + SVD + faiss product k-means)", f"{fit_seconds:.1f}",
                 f"{args.fit_sample / fit_seconds:,.0f}", f"{fit_seconds:.0f} (once)"])
    rows.append([f"base-model featurizer (demo-size path model), on {args.base_sample:,} prefixes only",
                 f"{args.base_sample / base_rate:.1f}", f"{base_rate:,.0f}",
                 f"{args.docs / base_rate:,.0f} (extrapolated: {args.docs / base_rate / 3600:.1f} h)"])
    mem_rows = [[f"{c['documents']:,}", f"{c['rss_mib']:.0f}", f"{c['peak_rss_mib']:.0f}", f"{c['seconds']:.0f}"]
                for c in checkpoints]
    markdown = "\n".join([
        f"# Routing {reached} to {'x'.join(map(str, levels))} paths, streamed (bench/bench_routing_1m.py)",
        "",
        f"The bundled corpus ({len(corpus):,} documents) repeated with seeded perturbations (first {KEEP_CHARS} "
        "characters, sentences shuffled, 10% of words dropped), generated one batch of "
        f"{args.batch:,} at a time; {args.prefix_tokens}-token prefixes, TF-IDF -> SVD 64 -> product k-means "
        f"({args.threads} threads). Making the perturbed documents took {seconds['make']:.0f} s (not counted).",
        "",
        markdown_table(["stage", "seconds", "docs/s", f"seconds for {args.docs:,}"], rows),
        "",
        f"Prefix step before/after (`prefix_texts`, first cut at {prefix_compare['chars_per_token_before']} vs "
        f"{prefix_compare['chars_per_token_after']} characters per token, same {prefix_compare['documents']:,} perturbed "
        f"documents side by side, best of 2, identical prefixes): {prefix_compare['docs_per_second_before']:,.0f} -> "
        f"{prefix_compare['docs_per_second_after']:,.0f} docs/s ({prefix_compare['speedup']:.1f}x).",
        "",
        f"Memory: resident {setup_rss / 1024:.0f} MiB after loading the corpus and the tokenizer, {stream_rss / 1024:.0f} "
        f"MiB when streaming began (router fitted); peak while streaming {stream_peak / 1024:.0f} MiB (of which the path "
        f"ids, 8 bytes a document: {paths.nbytes / MIB:.0f} MiB). Resident memory as the documents go by:",
        "",
        markdown_table(["documents", "RSS MiB", "peak RSS MiB (VmHWM since streaming began)", "seconds"], mem_rows),
        "",
        f"Path sizes: min {int(sizes.min()):,}, median {float(np.median(sizes)):,.0f}, max {int(sizes.max()):,}, "
        f"{int((sizes == 0).sum())} empty of {router.n_paths} (plain nearest centroid; `routing.balance` would "
        "bound the ratio).",
        "",
    ])
    write_results(args.name, results, markdown)


if __name__ == "__main__":
    main()
