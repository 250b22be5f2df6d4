"""Training metrics as TensorBoard event files, written by the round loop after each committed round.

    tensorboard --logdir runs/demo/tensorboard        # while `dipaco train` runs, or after

`RunMetrics.round` after each round, `RunMetrics.final` after the last version is scored (`run.tensorboard:
false` turns it off). Everything comes from what the round wrote (its `RoundStats`, manifest and the
applied results' metadata) and the outer step's norms; the step of a scalar is its module version. The
tags (train / val loss per path, outer gradient and update norms per module, bytes, the store traffic
measured so far, the round's stats, goodput) are listed in docs/islands.md#watching-a-run.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from dipaco.eval.early_stopping import read_history
from dipaco.store.board import read_manifest, read_result_meta
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import ResultMeta, RoundStats
from dipaco.store.traffic import ring_allreduce_bytes

log = logging.getLogger(__name__)

BYTES_DOWN = ("bytes_down_modules", "bytes_down_inner", "bytes_up_inner")


class RunMetrics:
    """The TensorBoard writer of one coordinator session (nothing is written when not `enabled`)."""

    def __init__(self, logdir: Path, *, enabled: bool):
        self.logdir = logdir
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            log.warning("run.tensorboard: the tensorboard package is not installed (%s); no event files are "
                        "written (pip install tensorboard, or set run.tensorboard=false)", err)
            return
        self.writer = SummaryWriter(log_dir=str(logdir))

    def round(self, store: ModuleStore, stats: RoundStats, *, norms: dict[str, tuple[float, float]],
              goodput: float | None = None, metas: dict[str, ResultMeta] | None = None,
              traffic: dict | None = None, workers: int = 1) -> None:
        """Round `stats.round`'s scalars (its manifest is read from `store`; a result's metadata is taken
        from `metas`, by task key, where the coordinator read it already, else read from `store`); `traffic`:
        the store traffic measured so far (`dipaco.store.ledger.Ledger.summary`), cumulative; `workers`: the run's
        islands, data parallel's workers (each all-reduces a float32 gradient per inner step in a ring)."""
        if self.writer is None:
            return
        t, add = stats.round, self.writer.add_scalar
        for path, loss in sorted(stats.train_loss.items()):
            add(f"train/loss/path-{path}", loss, t)
        manifest = read_manifest(store, t)
        moved = dict.fromkeys(BYTES_DOWN, 0)
        for entry in manifest.applied if manifest else ():
            if math.isfinite(entry.val_loss_start):
                add(f"val/loss/path-{entry.path}", entry.val_loss_start, entry.base)
            try:
                meta = (metas or {}).get(entry.key) or read_result_meta(store, round=entry.base + 1, path=entry.path,
                                                                         attempt=entry.attempt, link=entry.link)
            except StoreError as err:  # pruned already (a resumed round): its bytes are not known
                log.debug("no bytes for %s: %s", entry.key, err)
                continue
            for key in BYTES_DOWN:
                moved[key] += getattr(meta, key)
        for name, (grad, update) in sorted(norms.items()):
            add(f"outer/grad_norm/{name}", grad, t)
            add(f"outer/update_norm/{name}", update, t)
        add("bytes/up_pseudo_gradients", stats.bytes_up, t)
        add("bytes/float32_diloco", stats.bytes_float32, t)
        add("bytes/data_parallel", ring_allreduce_bytes(stats.bytes_data_parallel, workers), t)
        add("bytes/up_inner", moved["bytes_up_inner"], t)
        add("bytes/down_modules", moved["bytes_down_modules"], t)
        add("bytes/down_inner", moved["bytes_down_inner"], t)
        for key in ("seconds", "tokens", "applied", "stale", "dropped", "in_flight", "cancelled"):
            add(f"round/{key}", getattr(stats, key), t)
        add("outer/plain_average", float(stats.outer_step == "average"), t)
        if stats.outer is not None:  # the step as applied
            add("outer/lr", stats.outer.lr, t)
            add("outer/momentum", stats.outer.momentum, t)
        if goodput is not None and math.isfinite(goodput):
            add("goodput", goodput, t)
        if traffic:
            self._traffic(traffic, t)
        self.writer.flush()

    def _traffic(self, traffic: dict, t: int) -> None:
        """The measured store traffic so far: bytes and requests each way, and bytes by kind."""
        add = self.writer.add_scalar
        for direction in ("up", "down"):
            add(f"traffic/{direction}_bytes", traffic[f"{direction}_bytes"], t)
            add(f"traffic/{direction}_requests", traffic[f"{direction}_requests"], t)
            for kind, cell in traffic["by_kind"][direction].items():
                add(f"traffic/{direction}/{kind}", cell["bytes"], t)

    def final(self, store: ModuleStore, *, version: int) -> None:
        """The validation losses of the run's last version (scored after the last round)."""
        if self.writer is None:
            return
        for path, losses in sorted(read_history(store).items()):
            if version in losses and math.isfinite(losses[version]):
                self.writer.add_scalar(f"val/loss/path-{path}", losses[version], version)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
