"""Build the small lm-evaluation-harness tasks dipaco ships, dipaco/data/lm_eval/*.jsonl, from the
bundled demo corpus (dipaco/data/demo_corpus.jsonl.zst, the last documents, which configs/tiny.yaml does
not train on; the demo trains on every document, so these check the plumbing, not held-out quality):

- `demo_continuation.jsonl` (task `dipaco_demo_continuation`, multiple choice): the opening of a passage
  and four candidate continuations, the true one and three from other passages (one per source);
- `demo_text.jsonl` (task `dipaco_demo_text`, rolling log-likelihood): whole passages.

Run (CPU, a second): python scripts/build_lm_eval_tasks.py
"""

import argparse
import io
import json
import random
from pathlib import Path

import zstandard

from dipaco.data import demo_corpus_path

OUT = Path(__file__).resolve().parent.parent / "dipaco" / "data" / "lm_eval"


def cut(text: str, chars: int) -> str:
    """The first `chars` characters of `text`, cut back to the last space (whole words)."""
    head = text[:chars]
    return head[: head.rfind(" ")] if " " in head[1:] else head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=24, help="multiple-choice examples")
    parser.add_argument("--texts", type=int, default=12, help="passages for the rolling task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(demo_corpus_path(), "rb") as f:
        rows = [json.loads(line) for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f))]
    pool = [r for r in rows[-2000:] if len(r["text"]) >= 400]
    rng = random.Random(args.seed)
    sources = sorted({r["source"] for r in pool})
    examples = []
    for row in rng.sample(pool, args.examples):
        context = cut(row["text"], 160)
        truth = cut(row["text"][len(context):], 60)
        others = [rng.choice([r for r in pool if r["source"] == s and r is not row]) for s in sources]
        choices = [truth] + [" " + cut(r["text"][200:].lstrip(), len(truth)) for r in others[: 3]]
        order = list(range(len(choices)))
        rng.shuffle(order)
        examples.append({"context": context, "choices": [choices[i] for i in order], "label": order.index(0),
                         "source": row["source"]})
    texts = [{"text": cut(r["text"], 600), "source": r["source"]} for r in rng.sample(pool, args.texts)]
    OUT.mkdir(parents=True, exist_ok=True)
    for name, items in (("demo_continuation.jsonl", examples), ("demo_text.jsonl", texts)):
        (OUT / name).write_text("".join(json.dumps(item) + "\n" for item in items))
        print(f"wrote {len(items)} rows to {OUT / name}")


if __name__ == "__main__":
    main()
