"""Peak memory of `dipaco route` and `dipaco shard` on a corpus holding one huge document.

    python bench/bench_huge_document.py                 # a 50 MB document; about 5 min on 2 CPU cores
    python bench/bench_huge_document.py --mb 10

The corpus is the first 400 documents of the demo corpus plus one generated document of `--mb` MB (words
drawn from the demo corpus's vocabulary, seeded). Each stage runs in a fresh child process
(`python -m dipaco ...` through `dipaco.cli.main`) that reports its own peak resident memory (getrusage
ru_maxrss, which includes the interpreter and its imports), once with `sharding.max_encode_chars=0`
(whole documents: the behaviour before the setting existed) and once with the default (documents
tokenized in pieces). The run uses configs/tiny.yaml (trained BPE of 512 tokens).

Writes bench/results/huge-document.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import write_results  # noqa: E402

CHILD = ("import resource, sys\n"
         "from dipaco.cli import main\n"
         "code = main(sys.argv[1:])\n"
         "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 'CODE', code, flush=True)\n")


def make_corpus(path: Path, *, mb: float, seed: int = 0) -> int:
    """The demo corpus's first 400 documents and one document of `mb` MB; returns its length in chars."""
    import random

    from dipaco.pipeline.documents import load_run_corpus
    from routing.routing_config import CorpusConfig

    demo = load_run_corpus(CorpusConfig(path="demo", max_documents=400))["text"]
    lines = [json.dumps({"text": text, "source": "demo"}) for text in demo]
    words = sorted({w for text in demo for w in text.split()})
    rng = random.Random(seed)
    parts, size = [], 0
    while size < mb * 1e6:
        sentence = " ".join(rng.choices(words, k=rng.randint(8, 30))) + ". "
        parts.append(sentence)
        size += len(sentence)
    huge = "".join(parts)
    with open(path, "w") as f:
        for line in lines:
            f.write(line + "\n")
        f.write(json.dumps({"text": huge, "source": "generated"}) + "\n")
    return len(huge)


def measure(stage: str, run: Path, corpus: Path, max_chars: int | None) -> dict:
    args = [stage, "--config", str(ROOT / "configs" / "tiny.yaml"), "--run", str(run), f"corpus.path={corpus}",
            "corpus.max_documents=0"]
    if max_chars is not None:
        args.append(f"sharding.max_encode_chars={max_chars}")
    out = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("PEAK_KIB")]
    if out.returncode or not line or line[-1].split()[3] != "0":
        raise SystemExit(f"dipaco {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return {"stage": stage, "peak_mb": round(int(line[-1].split()[1]) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="size of the huge document in MB")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "huge.jsonl"
        chars = make_corpus(corpus, mb=args.mb)
        for label, max_chars in (("whole documents (max_encode_chars=0)", 0), ("pieces (default)", None)):
            run = Path(tmp) / f"run-{max_chars}"
            for stage in ("route", "shard"):
                row = measure(stage, run, corpus, max_chars)
                rows.append({"setting": label, **row})
                print(rows[-1], flush=True)
    results = {"document_chars": chars, "documents": 401, "rows": rows}
    table = ["| setting | stage | peak RSS (MB) |", "|---|---|---|"]
    table += [f"| {r['setting']} | {r['stage']} | {r['peak_mb']:,} |" for r in rows]
    markdown = (f"# Route and shard on one huge document\n\n"
                f"One document of {chars:,} characters and 400 demo documents, configs/tiny.yaml; peak resident "
                f"memory of each stage's process (interpreter and imports included).\n\n" + "\n".join(table) + "\n")
    write_results("huge-document", results, markdown)


if __name__ == "__main__":
    main()
