"""Typed configuration: one dataclass per component, loaded from YAML with `section.key=value` overrides.

    from dipaco.config import load_config
    cfg = load_config("configs/tiny.yaml", ["inner.steps=10", "topology.levels=[4,4]"])

Every field has a default and a one-line doc; each dataclass checks its values in `__post_init__`
and names the bad value (no float may be NaN or infinite: `check_finite`). An unknown key or a value of the wrong type is an error that names the key
and the file it came from. The corpus, routing and sharding sections live in their own packages
(`routing.config`, `sharding.config`) because those stages run without `dipaco`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dipaco.atomic import write_text
from routing.config import CorpusConfig, RoutingConfig
from sharding.config import ShardingConfig

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")


WEIGHTINGS = ("shard", "tokens", "uniform")  # outer.weighting (dipaco.optim.weighting)
NORMALIZATIONS = ("module", "all")  # outer.normalize
OUTER_DECAYS = ("keep", "average")  # outer.decay: the outer step in the inner lr's decay
SCHEDULES = ("cosine", "wsd")  # inner.schedule (dipaco.optim.inner.lr_at)
LAUNCHERS = ("local", "ray")  # train.launcher

BASELINE_INITS = ("warm-start", "scratch")  # eval.baselines_init (dipaco.eval.baselines)
EVAL_MODES = ("prefix", "likelihood", "oracle", "all-paths")  # plus every:W (dipaco.eval.modes)


def parse_mode(mode: str) -> tuple[str, int]:
    """`"every:64"` → `("every", 64)`; `"prefix"` → `("prefix", 0)`; anything else is an error."""
    if mode.startswith("every:"):
        try:
            window = int(mode[6:])
        except ValueError:
            window = 0
        if window < 1:
            raise ValueError(f"eval mode {mode!r}: the re-routing window must be an int >= 1, like every:64")
        return "every", window
    if mode not in EVAL_MODES:
        raise ValueError(f"unknown eval mode {mode!r}; modes are {list(EVAL_MODES)} and every:W (e.g. every:64)")
    return mode, 0


@dataclass(kw_only=True)
class ModelConfig:
    """The architecture of one path: a Llama-style decoder built by `transformers`."""

    hidden_size: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks per path (split into levels by the topology)
    n_heads: int = 4  # attention heads; hidden_size must be divisible by it
    intermediate_size: int = 0  # MLP width; 0 = 8/3 * hidden_size rounded up to a multiple of 32
    tie_embeddings: bool = True  # share the input embedding and the output head
    rope_theta: float = 10000.0  # rotary position embedding base
    init_std: float = 0.02  # std of the normal initialisation
    dropout: float = 0.0  # attention dropout

    def __post_init__(self) -> None:
        check_finite(self, "model")
        for name in ("hidden_size", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.n_heads:
            raise ValueError(
                f"model.hidden_size {self.hidden_size} is not divisible by model.n_heads {self.n_heads}"
            )
        if (self.hidden_size // self.n_heads) % 2:
            raise ValueError(f"head dim {self.hidden_size // self.n_heads} must be even for rotary embeddings")
        if self.intermediate_size < 0:
            raise ValueError(f"model.intermediate_size must be >= 0, got {self.intermediate_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.rope_theta <= 0 or self.init_std <= 0:
            raise ValueError(f"model.rope_theta and model.init_std must be > 0, got {self.rope_theta}, {self.init_std}")

    @property
    def mlp_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 32) * 32


@dataclass(kw_only=True)
class TopologyConfig:
    """How a path's blocks are grouped into levels of alternative modules."""

    levels: list[int] = field(default_factory=lambda: [2, 2])  # modules per level; paths = product
    blocks_per_level: list[int] = field(default_factory=list)  # [] = split model.n_layers evenly
    private_blocks: list[int] = field(default_factory=list)  # block indices owned by each path alone
    private_embeddings: bool = False  # embedding, final norm and head private to each path
    replicas: int = 1  # replica islands per path (DiLoCo): each trains on a random share of the path's documents

    def __post_init__(self) -> None:
        check_finite(self, "topology")
        if not self.levels or any(k < 1 for k in self.levels):
            raise ValueError(f"topology.levels must be a non-empty list of ints >= 1, got {self.levels}")
        if self.replicas < 1:
            raise ValueError(f"topology.replicas must be >= 1, got {self.replicas}")
        if any(b < 1 for b in self.blocks_per_level):
            raise ValueError(f"topology.blocks_per_level must be ints >= 1, got {self.blocks_per_level}")
        if self.blocks_per_level and len(self.blocks_per_level) != len(self.levels):
            raise ValueError(
                f"topology.blocks_per_level {self.blocks_per_level} has {len(self.blocks_per_level)} entries "
                f"but topology.levels {self.levels} has {len(self.levels)}"
            )


@dataclass(kw_only=True)
class InnerConfig:
    """The inner optimiser every island runs: AdamW with warmup and cosine decay (DiLoCo)."""

    steps: int = 25  # inner steps per round (H, the paper's tau)
    batch_size: int = 8  # sequences per inner step
    lr: float = 2e-3  # peak learning rate
    warmup_steps: int = 20  # linear warmup, counted over the whole run
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio at the last step of the run
    schedule: str = "cosine"  # cosine: warmup, then cosine decay, each phase (the warm start, the paths or a baseline after it) its own | wsd: one warmup-stable-decay schedule a model's whole run long: the warm start is its constant part and the phase continuing it neither warms up again nor restarts (docs/recipe.md#schedule)
    decay_fraction: float = 0.2  # wsd: the last fraction of a model's run (warm start included) over which the lr decays linearly to lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    val_batches: int = 4  # validation batches each island scores at the start of a task

    def __post_init__(self) -> None:
        check_finite(self, "inner")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"inner.steps and inner.batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"inner.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"inner.warmup_steps must be >= 0 and inner.min_lr_ratio in [0, 1], "
                f"got {self.warmup_steps}, {self.min_lr_ratio}"
            )
        if self.grad_clip < 0 or self.weight_decay < 0 or self.val_batches < 0:
            raise ValueError(
                f"inner.grad_clip, weight_decay and val_batches must be >= 0, "
                f"got {self.grad_clip}, {self.weight_decay}, {self.val_batches}"
            )
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"inner.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"inner.schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"inner.decay_fraction must be in (0, 1], got {self.decay_fraction}")


@dataclass(kw_only=True)
class OuterConfig:
    """The outer step: per module, a weighted average of pseudo-gradients, then Nesterov SGD."""

    lr: float = 0.7  # outer learning rate (DiLoCo / DiPaCo: 0.7)
    momentum: float = 0.9  # outer momentum (0.9)
    nesterov: bool = True  # Nesterov momentum
    weighting: str = "shard"  # weight each path's pseudo-gradient by the tokens of its training shard ("shard", the paper's shard size; x the share of the task trained), the "tokens" the task trained, or "uniform"
    normalize: str = "module"  # divide the weights by their sum over the module's reporting paths ("module": the paper's weighted average; routed ppl 767.9 vs 789.4 with the paper's step, 519.7 vs 536.2 with plain averaging, bench/results/outer-weighting.md) or over all paths ("all")
    rescale_by_paths: bool = True  # multiply a shared module's average by sqrt(paths through it) (DiPaCo)
    decay: str = "keep"  # the outer step of the rounds whose inner steps reach the inner lr's decay (inner.schedule wsd): keep this one, or "average": plain averaging (lr 1, momentum 0, no rescale, the momentum dropped), so outer momentum does not carry the stable phase's steps into the cooldown (docs/recipe.md#the-outer-step-in-the-decay)
    compression: str = "none"  # pseudo-gradients sent as none (float32) | int8 | int4 (per-row scales, then zstd)
    zstd_level: int = 1  # zstd level for compressed pseudo-gradients
    mode: str = "sync"  # sync: a round waits for every path | async: quorum + grace window, stale results down-weighted
    quorum: float = 0.5  # async: fraction of a module's paths that must report before its round can close
    grace_seconds: float = 2.0  # async: after the quorum, wait at most this long for the other paths
    staleness_power: float = 1.0  # async: a result s versions stale is weighted by (1 + s) ** -staleness_power
    max_staleness: int = 2  # async: results more than this many versions stale are dropped; a running task that falls that far behind is cancelled
    max_grad_norm_ratio: float = 50.0  # reject a result whose pseudo-gradient norm exceeds this times the median of its path's accepted norms; 0 = off
    max_rejections: int = 3  # stop the run when one task's results are rejected this many times (dipaco.store.validation)

    def __post_init__(self) -> None:
        check_finite(self, "outer")
        if self.lr <= 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"outer.lr must be > 0 and outer.momentum in [0, 1), got {self.lr}, {self.momentum}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"outer.weighting must be one of {list(WEIGHTINGS)}, got {self.weighting!r}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"outer.normalize must be one of {list(NORMALIZATIONS)}, got {self.normalize!r}")
        if self.compression not in ("none", "int8", "int4"):
            raise ValueError(f"outer.compression must be none, int8 or int4, got {self.compression!r}")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"outer.zstd_level must be in 1..22, got {self.zstd_level}")
        if self.decay not in OUTER_DECAYS:
            raise ValueError(f"outer.decay must be one of {list(OUTER_DECAYS)}, got {self.decay!r}")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"outer.mode must be 'sync' or 'async', got {self.mode!r}")
        if not 0 < self.quorum <= 1:
            raise ValueError(f"outer.quorum must be in (0, 1], got {self.quorum}")
        if self.grace_seconds < 0 or self.staleness_power < 0 or self.max_staleness < 0:
            raise ValueError(
                f"outer.grace_seconds, staleness_power and max_staleness must be >= 0, "
                f"got {self.grace_seconds}, {self.staleness_power}, {self.max_staleness}"
            )
        if self.max_grad_norm_ratio != 0 and self.max_grad_norm_ratio <= 1:
            raise ValueError(f"outer.max_grad_norm_ratio must be 0 (off) or > 1, got {self.max_grad_norm_ratio}")
        if self.max_rejections < 1:
            raise ValueError(f"outer.max_rejections must be >= 1, got {self.max_rejections}")


@dataclass(kw_only=True)
class TrainConfig:
    """The round loop and how local islands are run."""

    rounds: int = 8  # the run's length: every path has this many results (of inner.steps steps) applied; sync: this many outer rounds, async: versions until then
    islands: int = 0  # island processes run at once on this machine; 0 = min(paths, CPU cores)
    threads_per_island: int = 0  # torch threads per island process; 0 = cores // islands
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 where the device computes it natively, else fp32) | fp32 | bf16 (autocast)
    keep_rounds: int = 2  # module versions kept in the store (older ones are deleted); 0 = keep all
    store_url: str = ""  # fsspec URL of the module store; "" = <run>/store (s3://, gs://, NFS for clusters)
    cache_dir: str = ""  # where a store-only island or coordinator (--store URL) caches the shards it downloads; "" = $XDG_CACHE_HOME/dipaco or ~/.cache/dipaco
    cache_max_bytes: int = 10 * 2**30  # that cache's size: least recently used shards are deleted beyond it; 0 = no limit
    seed: int = 0  # model initialisation and data order
    heartbeat_seconds: float = 1.0  # how often an island writes its heartbeat file
    heartbeat_timeout: float = 30.0  # a task whose island has not heart-beaten for this long is handed to another
    lease_timeout: float = 60.0  # a coordinator's store lease not renewed for this long may be taken over (docs/islands.md#crash-safety)
    fail_mtbf: float = 0.0  # fault injection: islands fail at random with this mean time between failures (s); 0 = never
    return_after: float = 10.0  # fault injection: a failed island comes back after this many seconds
    fail_mode: str = "die"  # fault injection: die (the task is lost) | stall (stop heart-beating, then finish late)
    slowdown: float = 1.0  # fault injection: island-0 of `dipaco train` (or an island run with --slowdown) is this many times slower
    checkpoint_steps: int = 0  # islands save their task's inner state locally every this many inner steps (a restart resumes); 0 = never
    stop_after_round: int = 0  # 0 = train until the run's length (train.rounds) is applied; else stop after this round, i.e. module version (the LR schedule still spans train.rounds), e.g. to re-route midway
    compile: bool = False  # torch.compile each island's path model, once per island process (docs/islands.md#speed)
    fused_adamw: bool = False  # the islands' inner AdamW as torch's fused kernel (rounds differently from the default)
    tf32: bool = False  # on CUDA, fp32 matmuls on TF32 tensor cores (Ampere and later; matters with precision fp32)
    tensorboard: bool = True  # the coordinator writes per-round metrics as TensorBoard event files in <run>/tensorboard/
    launcher: str = "local"  # who starts the coordinator and the islands of `dipaco train`: local (processes here) | ray (docs/islands.md#clusters)
    ray_address: str = ""  # launcher ray: ray.init(address=...); "" = start a local Ray instance, "auto" = the running cluster, or host:port / ray://host:10001
    ray_island_cpus: int = 1  # launcher ray: CPUs each island asks Ray for (also its torch threads)
    ray_island_gpus: float = 0.0  # launcher ray: GPUs each island asks Ray for (set it with train.device cuda)
    ray_coordinator_cpus: float = 1.0  # launcher ray: CPUs the coordinator task asks Ray for
    ray_island_restarts: int = 3  # launcher ray: times Ray starts an island again whose process or node died

    def __post_init__(self) -> None:
        check_finite(self, "train")
        if self.seed < 0:
            raise ValueError(f"train.seed must be >= 0, got {self.seed}")
        if self.heartbeat_seconds <= 0 or self.heartbeat_timeout <= self.heartbeat_seconds:
            raise ValueError(
                f"train.heartbeat_seconds must be > 0 and below train.heartbeat_timeout, "
                f"got {self.heartbeat_seconds}, {self.heartbeat_timeout}"
            )
        if self.lease_timeout <= 0:
            raise ValueError(f"train.lease_timeout must be > 0, got {self.lease_timeout}")
        if self.fail_mtbf < 0 or self.return_after < 0:
            raise ValueError(f"train.fail_mtbf and return_after must be >= 0, got {self.fail_mtbf}, {self.return_after}")
        if self.fail_mode not in ("die", "stall"):
            raise ValueError(f"train.fail_mode must be 'die' or 'stall', got {self.fail_mode!r}")
        if self.slowdown < 1 or self.checkpoint_steps < 0:
            raise ValueError(f"train.slowdown must be >= 1 and train.checkpoint_steps >= 0, "
                             f"got {self.slowdown}, {self.checkpoint_steps}")
        if self.stop_after_round < 0:
            raise ValueError(f"train.stop_after_round must be >= 0, got {self.stop_after_round}")
        if self.cache_max_bytes < 0:
            raise ValueError(f"train.cache_max_bytes must be >= 0 (0 = no limit), got {self.cache_max_bytes}")
        if self.rounds < 1:
            raise ValueError(f"train.rounds must be >= 1, got {self.rounds}")
        if self.islands < 0 or self.threads_per_island < 0 or self.keep_rounds < 0:
            raise ValueError(
                f"train.islands, threads_per_island and keep_rounds must be >= 0, "
                f"got {self.islands}, {self.threads_per_island}, {self.keep_rounds}"
            )
        check_device_precision("train", self.device, self.precision)
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"train.launcher must be one of {list(LAUNCHERS)}, got {self.launcher!r}")
        if self.ray_island_cpus < 1 or self.ray_island_gpus < 0 or self.ray_coordinator_cpus < 0:
            raise ValueError(f"train.ray_island_cpus must be >= 1, ray_island_gpus and ray_coordinator_cpus >= 0, got "
                             f"{self.ray_island_cpus}, {self.ray_island_gpus}, {self.ray_coordinator_cpus}")
        if self.ray_island_restarts < 0:
            raise ValueError(f"train.ray_island_restarts must be >= 0, got {self.ray_island_restarts}")


@dataclass(kw_only=True)
class EvalConfig:
    """Routed evaluation and the dense baselines it is compared with."""

    batch_size: int = 16  # sequences per evaluation forward pass
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 where the device computes it natively, else fp32) | fp32 | bf16 (autocast)
    baselines: bool = True  # train dense 1x1 baselines at equal steps and at equal compute
    baselines_init: str = "warm-start"  # warm-start (path-sized baselines continue from the dense warm start, as in the papers) | scratch
    baselines_with_train: bool = True  # `dipaco run` trains the baselines alongside the islands (they share the cores)
    modes: list[str] = field(default_factory=lambda: ["prefix", "every:64", "likelihood", "oracle", "all-paths"])  # eval modes (dipaco.eval.modes)
    best: bool = False  # also evaluate each path at its best round by validation loss (early stopping)
    large_hidden_size: int = 0  # width of the "dense-large" baseline (~8x a path's parameters); 0 = no such baseline
    large_n_layers: int = 0  # blocks of "dense-large"; 0 = model.n_layers (its heads keep a path's head size)

    def __post_init__(self) -> None:
        check_finite(self, "eval")
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be >= 1, got {self.batch_size}")
        if self.large_hidden_size < 0 or self.large_n_layers < 0:
            raise ValueError(f"eval.large_hidden_size and eval.large_n_layers must be >= 0, "
                             f"got {self.large_hidden_size}, {self.large_n_layers}")
        check_device_precision("eval", self.device, self.precision)
        if self.baselines_init not in BASELINE_INITS:
            raise ValueError(f"eval.baselines_init must be one of {BASELINE_INITS}, got {self.baselines_init!r}")
        for mode in self.modes:
            try:
                parse_mode(mode)
            except ValueError as err:
                raise ValueError(f"eval.modes: {err}") from None


@dataclass(kw_only=True)
class PretrainConfig:
    """The dense warm start of `dipaco pretrain` (the paper starts every path from a dense model)."""

    steps: int = 0  # dense AdamW steps on all training documents (0 = no warm start)
    warm_start: bool = True  # initialise every module of the grid from the pretrained model when it exists
    continue_optimizer: bool = False  # the paths and the baselines continuing the warm start also start from its AdamW moments and step counts (a resumed run), not a fresh AdamW

    def __post_init__(self) -> None:
        check_finite(self, "pretrain")
        if self.steps < 0:
            raise ValueError(f"pretrain.steps must be >= 0, got {self.steps}")


@dataclass(kw_only=True)
class SimulateConfig:
    """`dipaco simulate`: the chaos simulator's cluster, failures and workload (docs/simulate.md)."""

    learners: int = 8  # DiLoCo learners (islands), each a data-parallel group of chips_per_learner chips
    chips_per_learner: int = 150_000  # chips in one learner; data parallel runs on learners x this many
    chip_mtbi_hours: float = 8766.0  # mean time between interruptions of one chip (8766 h = 1 year)
    restart_seconds: float = 30.5  # a stopped job or learner is back this long after its last chip failure (fitted: docs/simulate.md)
    reconfigure_seconds: float = 6.8  # elastic: every chip of the group pauses this long when a chip leaves or returns (fitted)
    learner_failure: str = "elastic"  # what a DiLoCo learner does on a chip failure: elastic (shrink, go on) | restart
    checkpoint_steps: int = 5  # a restart resumes from the last checkpoint, taken every this many steps
    step_seconds: float = 2.0  # one training step (inner step) on any group of chips
    inner_steps: int = 100  # inner steps per DiLoCo task (round)
    speed_sigma: float = 0.05  # log-normal sigma of a learner's speed per task (stragglers); 0 = identical speeds
    model_parameters: int = 12_000_000_000  # parameters of the model (for the bytes each strategy moves)
    parameter_bytes: float = 2.0  # bytes per parameter of gradients (data parallel) and downloaded modules
    link_gbit_per_s: float = 100.0  # each learner's link to the others / the syncer; sync rounds wait for the transfer
    horizon_hours: float = 24.0  # simulated wall-clock time of each run
    seed: int = 0  # failure times and speeds (numpy)
    sweep_chips: list[int] = field(default_factory=lambda: [150_000, 300_000, 600_000, 1_200_000, 2_400_000])  # total chips of the goodput-vs-chips plot
    sweep_learners: list[int] = field(default_factory=lambda: [1, 2, 8, 16])  # learner counts of the plot (async rounds)

    def __post_init__(self) -> None:
        if self.learners < 1 or self.chips_per_learner < 1 or self.inner_steps < 1 or self.checkpoint_steps < 1:
            raise ValueError(
                f"simulate.learners, chips_per_learner, inner_steps and checkpoint_steps must be >= 1, got "
                f"{self.learners}, {self.chips_per_learner}, {self.inner_steps}, {self.checkpoint_steps}")
        positive = ("chip_mtbi_hours", "step_seconds", "horizon_hours", "model_parameters", "parameter_bytes",
                    "link_gbit_per_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"simulate.{name} must be > 0, got {getattr(self, name)}")
        if self.restart_seconds < 0 or self.reconfigure_seconds < 0 or self.speed_sigma < 0:
            raise ValueError(
                f"simulate.restart_seconds, reconfigure_seconds and speed_sigma must be >= 0, got "
                f"{self.restart_seconds}, {self.reconfigure_seconds}, {self.speed_sigma}")
        if self.learner_failure not in ("elastic", "restart"):
            raise ValueError(f"simulate.learner_failure must be 'elastic' or 'restart', got {self.learner_failure!r}")
        if not self.sweep_chips or any(c < 1 for c in self.sweep_chips):
            raise ValueError(f"simulate.sweep_chips must be a non-empty list of ints >= 1, got {self.sweep_chips}")
        if not self.sweep_learners or any(n < 1 for n in self.sweep_learners):
            raise ValueError(f"simulate.sweep_learners must be a non-empty list of ints >= 1, got {self.sweep_learners}")


@dataclass(kw_only=True)
class Config:
    """The whole run: one section per component."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)

    def __post_init__(self) -> None:
        blocks = self.topology.blocks_per_level
        if blocks and sum(blocks) != self.model.n_layers:
            raise ValueError(
                f"topology.blocks_per_level {blocks} sums to {sum(blocks)}, "
                f"but model.n_layers is {self.model.n_layers}"
            )
        if not blocks and self.model.n_layers < len(self.topology.levels):
            raise ValueError(
                f"model.n_layers {self.model.n_layers} is fewer than the "
                f"{len(self.topology.levels)} levels of topology.levels {self.topology.levels}"
            )
        bad = [b for b in self.topology.private_blocks if not 0 <= b < self.model.n_layers]
        if bad:
            raise ValueError(
                f"topology.private_blocks {bad} are outside the model's blocks 0..{self.model.n_layers - 1}"
            )
        head = self.model.hidden_size // self.model.n_heads
        if self.eval.large_hidden_size % head:
            raise ValueError(f"eval.large_hidden_size {self.eval.large_hidden_size} is not a multiple of a path's "
                             f"head size {head} (model.hidden_size / model.n_heads)")
        if self.outer.decay != "keep" and self.inner.schedule != "wsd":
            raise ValueError(f"outer.decay {self.outer.decay!r} acts in the decay of inner.schedule wsd; "
                             f"inner.schedule is {self.inner.schedule!r}")
        if self.routing.prefix_tokens >= self.sharding.seq_len:
            raise ValueError(
                f"routing.prefix_tokens {self.routing.prefix_tokens} leaves nothing to score in "
                f"sequences of sharding.seq_len {self.sharding.seq_len}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_finite(section: Any, name: str) -> None:
    """Refuse a NaN or infinite float in a config section, naming the key (every section calls it first)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}.{f.name} must be a finite number, got {value}")


def check_device_precision(section: str, device: str, precision: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"{section}.device must be one of {DEVICES}, got {device!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"{section}.precision must be one of {PRECISIONS}, got {precision!r}")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Build a Config from a YAML file (or the defaults) and `section.key=value` overrides."""
    source = str(path) if path else "<defaults>"
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist") from None
        except IsADirectoryError:
            raise ValueError(f"config file {path} is a directory; give a YAML file such as configs/tiny.yaml") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"config file {path} is not UTF-8 text (byte {err.start}); give a YAML file") from None
        except OSError as err:
            raise ValueError(f"config file {path} cannot be read: {err.strerror or err}") from None
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        parts = key.split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ValueError(f"override {item!r} must look like section.key=value")
        section, name = parts
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ValueError(f"section {section!r} in {source} must be a mapping")
        try:
            raw[section][name] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError as err:
            raise ValueError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return _build(Config, raw, source=source, prefix="")


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically), so islands and later stages read the same values."""
    write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))


def _build(cls: type, raw: dict[str, Any], *, source: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"unknown key {prefix}{unknown[0]} in {source}; known keys: {sorted(fields)}")
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ValueError(f"{key} in {source} must be a mapping, got {value!r}")
            kwargs[name] = _build(hint, value, source=source, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(value, hint, key=key, source=source)
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ValueError(f"{err} (in {source})") from None


def _coerce(value: Any, hint: Any, *, key: str, source: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key=key, source=source)
            except ValueError:
                pass
    elif origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool) and item is not str:
            value = [value]
        if isinstance(value, list):
            return [_coerce(v, item, key=key, source=source) for v in value]
    elif hint is bool and isinstance(value, bool):
        return value
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{key} in {source} must be a finite number, got {value}")
        return float(value)
    elif hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{key} in {source} must be {_type_name(hint)}, got {value!r}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
