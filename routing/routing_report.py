"""The routing report written after each routing step: path sizes, churn, agreement with a label.

`routing_report(paths=..., split=..., n_paths=...)` summarises one assignment of documents to paths:
- sizes of the training split per path: min / median / max, the balance ratio max / min, empty paths;
- `changed`: the share of documents whose path differs from a `previous` assignment (re-routing);
- `purity` and `nmi` (scikit-learn's normalised mutual information) of the training documents'
  paths against a label per document (the corpus's `source` field) when one is given.
`write_report` writes `<name>.json`, `<name>.md` (the table) and `<name>.png` (a histogram of path
sizes, matplotlib's Agg backend). CPU check:

    python -c "import numpy as np; from routing.routing_report import routing_report, format_report; \
print(format_report(routing_report(paths=np.arange(10) % 3, split=np.zeros(10, 'int8'), n_paths=3)))"
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .corpus import TRAIN


def purity(clusters: np.ndarray, labels: list[str] | np.ndarray) -> float:
    """Share of documents whose label is the most common label of their cluster."""
    labels = np.asarray(labels)
    if len(labels) == 0:
        return float("nan")
    hits = 0
    for c in np.unique(clusters):
        hits += Counter(labels[clusters == c].tolist()).most_common(1)[0][1]
    return hits / len(labels)


def routing_report(
    *,
    paths: np.ndarray,
    split: np.ndarray,
    n_paths: int,
    previous: np.ndarray | None = None,
    labels: list[str] | None = None,
    train_paths: np.ndarray | None = None,
    name: str = "routing",
) -> dict[str, Any]:
    """Summary of one routing (see the module docstring); `train_paths` (N, k) counts overlap copies."""
    from sklearn.metrics import normalized_mutual_info_score

    paths = np.asarray(paths, dtype=np.int64)
    split = np.asarray(split)
    train = split == TRAIN
    if train_paths is not None:
        flat = train_paths[train].ravel()
        sizes = np.bincount(flat[flat >= 0], minlength=n_paths)
    else:
        sizes = np.bincount(paths[train], minlength=n_paths)
    report: dict[str, Any] = {
        "name": name,
        "documents": int(len(paths)),
        "train_documents": int(train.sum()),
        "n_paths": n_paths,
        "sizes": sizes.tolist(),
        "min": int(sizes.min()),
        "median": float(np.median(sizes)),
        "max": int(sizes.max()),
        "balance": float(sizes.max() / sizes.min()) if sizes.min() else float("inf"),
        "empty_paths": int((sizes == 0).sum()),
        "changed": None,
        "purity": None,
        "nmi": None,
    }
    if previous is not None:
        if len(previous) != len(paths):
            raise ValueError(f"previous assignment has {len(previous)} documents, this one {len(paths)}")
        report["changed"] = float(np.mean(np.asarray(previous) != paths)) if len(paths) else 0.0
    if labels is not None:
        lab = np.asarray(labels)[train]
        report["purity"] = purity(paths[train], lab)
        report["nmi"] = float(normalized_mutual_info_score(lab, paths[train]))
        report["top_label"] = []
        for p in range(n_paths):
            members = lab[paths[train] == p]
            if len(members):
                top, count = Counter(members.tolist()).most_common(1)[0]
                report["top_label"].append({"label": top, "share": count / len(members)})
            else:
                report["top_label"].append(None)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a small text table (also the markdown written by `write_report`)."""
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    keys = ["train_documents", "n_paths", "min", "median", "max", "balance", "empty_paths", "changed",
            "purity", "nmi"]
    lines = [f"| {report['name']} | value |", "|---|---|"]
    lines += [f"| {k} | {fmt(report[k])} |" for k in keys]
    return "\n".join(lines)


def write_report(report: dict[str, Any], directory: str | Path, *, name: str | None = None) -> Path:
    """Write <name>.json, <name>.md and <name>.png (path-size histogram) into `directory`; returns the JSON path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = name or report["name"]
    for suffix, text in ((".json", json.dumps(report, indent=1) + "\n"), (".md", format_report(report) + "\n")):
        tmp = directory / f".{name}{suffix}.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / f"{name}{suffix}")
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(np.arange(report["n_paths"]), report["sizes"], width=1.0)
    ax.set_xlabel("path")
    ax.set_ylabel("training documents")
    ax.set_title(f"{name}: balance {report['balance']:.2f}, {report['empty_paths']} empty")
    fig.tight_layout()
    tmp = directory / f".{name}.png.tmp"
    fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)
    os.replace(tmp, directory / f"{name}.png")
    return directory / f"{name}.json"
