"""The coordinator's side of compressed downloads (`compression.download: update`): per module, the update
that takes version round − 1 to `round`, published beside the version, and the version it defines.

    publisher = UpdatePublisher(store, codec=Codec.of("topk", ...), final=False)
    params = publisher.publish(round, name, before=params_before, after=outer_updated)   # what to commit
    manifest = dataclasses.replace(manifest, downloads=publisher.summary())

A module the outer step changed: u = before − after; with its download residual r (kept in the outer state
of the previous version, so a coordinator restart keeps it; absent = 0) the codec encodes a = u + r, the
bytes go to `updates/<version>/<module><codec suffix>`, the new residual a − d is staged with the outer state,
and the committed module is `apply_update(before, bytes)` = before − d: the same function the islands run
(`dipaco.codec.update`). A module no result touched is unchanged (no update; its residual is carried on).
The run's last version (`final`) flushes: every module with a residual sends u + r in float32 (codec `none`),
so the final model loses nothing; the summary then reports the residual the flush sent.

With `compression.download: results` (`gather`), a module whose step is a plain weighted average and that
carries no download residual is published as the round's results themselves (`publish_results`,
`dipaco.codec.contributions`: the encoded contributions copied, nothing re-encoded, no residual); the others
as above.
"""

from __future__ import annotations

import math

import torch

from dipaco.codec.codec import Codec
from dipaco.codec.contributions import SUFFIX, Contribution, apply_contributions, pack
from dipaco.codec.update import FLOAT32, apply_update, encode_update
from dipaco.config import OuterConfig
from dipaco.store.module_store import ModuleStore
from dipaco.store.records import DownloadUpdates

Tensors = dict[str, torch.Tensor]


class UpdatePublisher:
    def __init__(self, store: ModuleStore, *, codec: Codec, final: bool, gather: bool = False):
        """`codec`: compression.codec and its settings; `final`: the version is the run's last (the flush);
        `gather`: publish a plain average's results themselves (`compression.download: results`)."""
        self.store, self.codec, self.final, self.gather = store, codec, final, gather
        self.bytes = self.modules = self.float32_bytes = self.gathered = 0
        self.residuals: list[float] = []  # per module: ‖r‖ / ‖θ‖ after the round (before the flush, in a flush)

    def publish(self, round: int, name: str, *, before: Tensors, after: Tensors | None) -> Tensors:
        """Module `name`'s version `round` as committed: `before` − d (`after`: the outer step's result; None
        when no result touched the module: unchanged, unless the flush sends its residual)."""
        residual = self.store.read_download_residual(round - 1, name)
        if after is None and not (self.final and residual):
            if residual:  # carried on to the next version's outer state
                self.store.write_download_residual(round, name, residual)
            self.residuals.append(_ratio(residual, before))
            return before
        codec = FLOAT32 if self.final else self.codec
        data, _, left, _ = encode_update(before, before if after is None else after, module=name, codec=codec,
                                         residual=residual)
        committed = apply_update(before, data, module=name, codec=codec)
        self.store.write_update(round, name, data, suffix=codec.suffix)
        if left:
            self.store.write_download_residual(round, name, left)
        self.bytes += len(data)
        self.modules += 1
        self.float32_bytes += 4 * sum(t.numel() for t in before.values())
        self.residuals.append(_ratio(residual if self.final else left, committed))
        return committed

    def gathers(self, round: int, name: str, config: OuterConfig) -> bool:
        """Module `name`'s version `round` is published as its results: gather mode, a plain weighted average
        (outer lr 1, no momentum, no rescale) and no download residual left by an earlier encoded update."""
        plain = config.lr == 1.0 and config.momentum == 0 and not config.rescale_by_paths
        return self.gather and plain and not self.store.read_download_residual(round - 1, name)

    def publish_results(self, round: int, name: str, *, before: Tensors,
                        contributions: list[tuple[Contribution, bytes]]) -> Tensors:
        """Module `name`'s version `round` as committed: `before` − Σ w_i Δ_i over `contributions` (each with its
        bytes as its result holds them), published as `updates/<round>/<name>.results.safetensors`."""
        data = pack(name, contributions)
        committed = apply_contributions(before, data, module=name)
        self.store.write_update(round, name, data, suffix=SUFFIX)
        self.bytes += len(data)
        self.modules += 1
        self.gathered += 1
        self.float32_bytes += 4 * sum(t.numel() for t in before.values())
        self.residuals.append(0.0)
        return committed

    def summary(self) -> DownloadUpdates:
        """What this round published, for its manifest."""
        found = self.residuals or [0.0]
        return DownloadUpdates(bytes=self.bytes, modules=self.modules, float32_bytes=self.float32_bytes,
                               residual_max=max(found), residual_mean=sum(found) / len(found), flush=self.final,
                               gathered=self.gathered)


def _ratio(residual: Tensors, params: Tensors) -> float:
    """‖r‖ / ‖θ‖ over a module's parameters (0 without a residual)."""
    if not residual:
        return 0.0
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in params.values()))
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in residual.values())) / max(norm, 1e-30)
