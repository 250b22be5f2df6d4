"""The datasets of dipaco's lm-evaluation-harness tasks: JSON lines next to this file, read from any
working directory (the task YAMLs name these functions with `!function`). Built by
scripts/build_lm_eval_tasks.py from the bundled demo corpus."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def continuation(**_ignored) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(HERE / "demo_continuation.jsonl")})


def text(**_ignored) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(HERE / "demo_text.jsonl")})
