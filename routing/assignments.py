"""Every document's path and split, as routed (`dipaco route`, `dipaco reroute`), on disk as
`assignments.safetensors` + `assignments.json` (counts per path per split, sha256 of the tensors).

    Assignments(path=paths, split=split, levels=[2, 2], router_fingerprint=router.fingerprint()).save(out)
    Assignments.load(out).train_paths()
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from routing.artifacts import FORMAT_VERSION, hash_tensors, read_json, read_tensors, write_json, write_tensors
from routing.corpus import SPLIT_NAMES, TRAIN

ASSIGN_JSON, ASSIGN_TENSORS = "assignments.json", "assignments.safetensors"


def check_levels(levels: list[int]) -> list[int]:
    levels = [int(k) for k in levels]
    if not levels or any(k < 1 for k in levels):
        raise ValueError(f"levels must be a non-empty list of positive module counts, got {levels}")
    return levels


@dataclass
class Assignments:
    """Flat path id and split code per document (index = doc_id)."""

    path: np.ndarray  # (N,) int64 flat path id in [0, prod(levels))
    split: np.ndarray  # (N,) int8 split code (routing.corpus.TRAIN / TEST)
    levels: list[int]  # modules per level, as in the router
    router_fingerprint: str  # Router.fingerprint() of the router that made `path`
    topk: np.ndarray | None = None  # (N, k) int64: a training doc's k paths (first = `path`); -1 rows elsewhere

    def __post_init__(self) -> None:
        self.levels = check_levels(self.levels)
        self.path = np.asarray(self.path, dtype=np.int64)
        self.split = np.asarray(self.split, dtype=np.int8)
        if self.path.ndim != 1 or self.path.shape != self.split.shape:
            raise ValueError(
                f"path {self.path.shape} and split {self.split.shape} must be equal-length 1-D arrays"
            )
        if len(self.path) and (self.path.min() < 0 or self.path.max() >= self.n_paths):
            raise ValueError(
                f"path ids span [{self.path.min()}, {self.path.max()}], outside [0, {self.n_paths}) for levels {self.levels}"
            )
        unknown = sorted(set(np.unique(self.split).tolist()) - set(SPLIT_NAMES))
        if unknown:
            raise ValueError(f"unknown split codes {unknown}; known: {SPLIT_NAMES}")
        if self.topk is not None:
            self.topk = np.asarray(self.topk, dtype=np.int64)
            train = self.split == TRAIN
            if self.topk.ndim != 2 or len(self.topk) != len(self.path):
                raise ValueError(f"topk must have shape (N={len(self.path)}, k), got {self.topk.shape}")
            if (self.topk[train, 0] != self.path[train]).any() or (self.topk[~train] != -1).any():
                raise ValueError("topk rows must start with the doc's path (train docs) and be -1 elsewhere")
            top = self.topk[train]
            if top.size and (top.min() < 0 or top.max() >= self.n_paths or
                             (top.shape[1] > 1 and (np.sort(top, axis=1)[:, 1:] == np.sort(top, axis=1)[:, :-1]).any())):
                raise ValueError(f"topk of training docs must be distinct path ids in [0, {self.n_paths})")

    @property
    def n_paths(self) -> int:
        return math.prod(self.levels)

    def __len__(self) -> int:
        return len(self.path)

    def sizes(self, split: int = TRAIN) -> np.ndarray:
        """Documents per path (n_paths,) int64 in the given split."""
        if split not in SPLIT_NAMES:
            raise ValueError(f"unknown split code {split}; known: {SPLIT_NAMES}")
        return np.bincount(self.path[self.split == split], minlength=self.n_paths).astype(np.int64)

    def _tensors(self) -> dict[str, np.ndarray]:
        tensors = {"path": self.path, "split": self.split}
        if self.topk is not None:
            tensors["topk"] = self.topk
        return tensors

    def train_paths(self) -> np.ndarray:
        """(N, k) paths each document is trained on: top-k for training docs, -1 elsewhere (k = 1
        without overlap)."""
        if self.topk is not None:
            return self.topk
        return np.where(self.split == TRAIN, self.path, -1)[:, None]

    def save(self, directory: str | Path) -> Path:
        """Write assignments.safetensors then assignments.json into `directory` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = self._tensors()
        write_tensors(directory / ASSIGN_TENSORS, tensors)
        h = hashlib.sha256()
        hash_tensors(tensors, h)
        meta = {
            "format_version": FORMAT_VERSION,
            "n_documents": len(self),
            "levels": self.levels,
            "n_paths": self.n_paths,
            "router_fingerprint": self.router_fingerprint,
            "counts": {name: self.sizes(code).tolist() for code, name in SPLIT_NAMES.items()},
            "tensors_sha256": h.hexdigest(),
        }
        write_json(directory / ASSIGN_JSON, meta)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> Assignments:
        """Read assignments saved by `save`; checks version, lengths and checksum."""
        directory = Path(directory)
        meta = read_json(directory / ASSIGN_JSON)
        tensor_file = directory / ASSIGN_TENSORS
        tensors = read_tensors(tensor_file)
        if set(tensors) - {"topk"} != {"path", "split"}:
            raise ValueError(f"{tensor_file} holds tensors {sorted(tensors)}, expected ['path', 'split'] (+ 'topk')")
        n = meta["n_documents"]
        if len(tensors["path"]) != n or len(tensors["split"]) != n:
            raise ValueError(
                f"{tensor_file} has {len(tensors['path'])} paths and {len(tensors['split'])} splits, "
                f"but {directory / ASSIGN_JSON} says {n} documents"
            )
        h = hashlib.sha256()
        hash_tensors(tensors, h)
        if h.hexdigest() != meta["tensors_sha256"]:
            raise ValueError(f"{tensor_file} does not match the checksum in {directory / ASSIGN_JSON}")
        return cls(
            path=tensors["path"],
            split=tensors["split"],
            levels=meta["levels"],
            router_fingerprint=meta["router_fingerprint"],
            topk=tensors.get("topk"),
        )
