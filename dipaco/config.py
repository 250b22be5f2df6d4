"""Typed configuration: one dataclass per concern, loaded from YAML with `section.key=value` overrides.

    from dipaco.config import load_config
    cfg = load_config("configs/tiny.yaml", ["inner.steps=10", "topology.levels=[4,4]"])

The defaults are the recipe (a dense warm start of half the run, routing on its features, wsd inner
schedule, path-private embeddings, DiLoCo's Nesterov outer step before the inner lr's decay and plain
averaging in it: with that warm start on 4 paths every round is in the decay, docs/outer-step.md): a
config names only what differs (corpus, sizes, budget). Each field's type says what it allows
(`Literal` choices, `Range` bounds: `routing.fields`), and one validator checks every section; the
few rules that tie fields together sit in `__post_init__`. An unknown key, a wrong type or a renamed key (`config_keys`)
is an error that names the key and the file. The corpus, routing and sharding sections live in their
own packages because those stages run without `dipaco`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from dipaco.atomic import write_text
from dipaco.codec.registry import NAMES as CODECS
from dipaco.config_keys import build_config, read_raw
from routing.fields import Count, NonNegative, Positive, PositiveInt, Range, Section, Seed
from routing.routing_config import CorpusConfig, RerouteConfig, RoutingConfig
from sharding.sharding_config import ShardingConfig

Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["auto", "fp32", "bf16"]
PRECISIONS = ("auto", "fp32", "bf16")
EVAL_MODES = ("prefix", "likelihood", "oracle", "oracle-split", "all-paths")  # plus every:W, likelihood:K (dipaco.eval.modes)
Unit = Annotated[float, Range(min=0, below=1)]


def parse_mode(mode: str) -> tuple[str, int]:
    """`"every:64"` → `("every", 64)`; `"likelihood:4"` → `("likelihood", 4)` (among the router's 4 best
    paths); `"prefix"` → `("prefix", 0)`; anything else is an error."""
    for kind, what in (("every", "the re-routing window"), ("likelihood", "the router's candidate paths")):
        if mode.startswith(f"{kind}:"):
            number = mode[len(kind) + 1:]
            if not number.isdigit() or int(number) < 1:
                raise ValueError(f"eval mode {mode!r}: {what} must be an int >= 1, like {kind}:4")
            return kind, int(number)
    if mode not in EVAL_MODES:
        raise ValueError(f"unknown eval mode {mode!r}; modes are {list(EVAL_MODES)}, every:W (e.g. every:64) and "
                         "likelihood:K (e.g. likelihood:4)")
    return mode, 0


@dataclass(kw_only=True)
class ModelConfig(Section):
    """The architecture of one path: a Llama-style decoder built by `transformers`."""

    section = "model"
    hidden_size: PositiveInt = 128  # width of the residual stream
    n_layers: PositiveInt = 4  # transformer blocks per path (split into levels by the topology)
    n_heads: PositiveInt = 4  # attention heads; hidden_size must be divisible by it
    intermediate_size: Count = 0  # MLP width; 0 = 8/3 * hidden_size rounded up to a multiple of 32
    tie_embeddings: bool = True  # share the input embedding and the output head
    rope_theta: Positive = 10000.0  # rotary position embedding base
    init_std: Positive = 0.02  # std of the normal initialisation
    dropout: Unit = 0.0  # attention dropout

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.n_heads:
            raise ValueError(f"model.hidden_size {self.hidden_size} is not divisible by model.n_heads {self.n_heads}")
        if (self.hidden_size // self.n_heads) % 2:
            raise ValueError(f"head dim {self.hidden_size // self.n_heads} (model.hidden_size / model.n_heads) "
                             f"must be even for rotary embeddings")

    @property
    def mlp_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 32) * 32


@dataclass(kw_only=True)
class TopologyConfig(Section):
    """How a path's blocks are grouped into levels of alternative modules."""

    section = "topology"
    levels: list[PositiveInt] = field(default_factory=lambda: [2, 2])  # modules per level; paths = product
    blocks_per_level: list[PositiveInt] = field(default_factory=list)  # [] = split model.n_layers evenly
    private_blocks: list[Count] = field(default_factory=list)  # block indices owned by each path alone
    private_embeddings: bool = True  # embedding, final norm and head private to each path (the blocks stay shared by level)
    replicas: PositiveInt = 1  # replica islands per path (DiLoCo): each trains on a random share of the path's documents

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.levels:
            raise ValueError("topology.levels must be a non-empty list of ints >= 1, got []")
        if self.blocks_per_level and len(self.blocks_per_level) != len(self.levels):
            raise ValueError(f"topology.blocks_per_level {self.blocks_per_level} has {len(self.blocks_per_level)} "
                             f"entries but topology.levels {self.levels} has {len(self.levels)}")


@dataclass(kw_only=True)
class WarmStartConfig(Section):
    """The dense warm start (`dipaco pretrain`): one path-sized model trained on every training document,
    from which every module starts and whose features route the documents."""

    section = "warm_start"
    fraction: Unit = 0.5  # share of the run's path-model steps spent on the warm start: steps = fraction / (1 - fraction) x paths x replicas x run.rounds x inner.steps; 0 = none
    init_modules: bool = True  # initialise every module of the grid from the warm start (False: it only routes)
    continue_optimizer: bool = True  # the paths and the baselines continue the warm start's AdamW moments and step counts rather than a fresh AdamW


@dataclass(kw_only=True)
class InnerConfig(Section):
    """The inner optimiser every island runs: AdamW (or Muon on the blocks' matrices) on a warmup-stable-decay (or cosine) schedule."""

    section = "inner"
    optimizer: Literal["adamw", "muon"] = "adamw"  # adamw | muon: torch.optim.Muon on the 2-D weights of the transformer blocks (its update scaled to AdamW's RMS, so lr and weight_decay carry over) and AdamW on the rest: embeddings, norms, the head (MuLoCo); needs a torch with torch.optim.Muon
    steps: PositiveInt = 10  # inner steps per round (H, the paper's tau)
    batch_size: PositiveInt = 8  # sequences per inner step
    lr: Positive = 3e-3  # peak learning rate
    warmup_steps: Count = 20  # linear warmup, counted over the whole run
    min_lr_ratio: Annotated[float, Range(min=0, max=1)] = 0.1  # the schedule decays to lr * min_lr_ratio at the last step of the run
    schedule: Literal["wsd", "cosine"] = "wsd"  # wsd: one warmup-stable-decay schedule a model's whole run long (the warm start is its stable part; the paths continue it without a second warmup) | cosine: warmup then cosine decay, each phase (warm start, paths, a baseline) its own
    decay_fraction: Annotated[float, Range(above=0, max=1)] = 0.2  # wsd: the last fraction of a model's run (warm start included) over which the lr decays linearly to lr * min_lr_ratio
    weight_decay: NonNegative = 0.1  # AdamW decoupled weight decay
    beta1: Unit = 0.9  # AdamW beta1
    beta2: Unit = 0.95  # AdamW beta2
    grad_clip: NonNegative = 1.0  # max global gradient norm; 0 = no clipping
    fused: bool = False  # torch's fused AdamW kernel (rounds differently from the default one)
    val_batches: Count = 4  # validation batches each island scores at the start of a task

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optimizer == "muon":
            torch = importlib.import_module("torch")  # only here: the config itself runs without torch
            if not hasattr(torch.optim, "Muon"):
                raise ValueError(f"inner.optimizer 'muon' needs torch.optim.Muon, which torch {torch.__version__} "
                                 "does not have (torch 2.9 and later): upgrade torch or set inner.optimizer: adamw")


@dataclass(kw_only=True)
class OuterConfig(Section):
    """The outer step: per module, a weighted average of the paths' pseudo-gradients, then Nesterov SGD or (`decay`) a plain average."""

    section = "outer"
    lr: Positive = 0.7  # outer learning rate (DiLoCo / DiPaCo: 0.7)
    momentum: Unit = 0.9  # outer momentum (0.9)
    nesterov: bool = True  # Nesterov momentum
    weighting: Literal["shard", "tokens", "uniform"] = "shard"  # one weight per path and round: the tokens of its training shard (the paper's shard size), the tokens per inner step it trained (data-parallel ranks included), or uniform; a result cut short weighs as much (its pseudo-gradient holds only its steps)
    normalize: Literal["module", "all"] = "module"  # divide the weights by their sum over the module's reporting paths (the paper's weighted average) or over all paths
    rescale_by_paths: bool = False  # multiply a shared module's average by sqrt(paths through it) (the paper's DiPaCo step)
    decay: Literal["average", "keep"] = "average"  # the rounds whose inner steps reach the inner lr's decay (inner.schedule wsd): average = plain averaging (lr 1, momentum 0, no rescale, the momentum dropped) | keep = this outer step
    private_modules: Literal["synced", "local"] = "synced"  # a module only one path trains (its private embeddings and head): synced = sent by every task the round syncs it in | local = it stays on the path's island, its training carried with the path (and its inner checkpoints) and sent by the path's last task only
    fragments: PositiveInt = 1  # K: the grid's modules split into K fragments of about equal upload, a round syncing one of them in turn (Streaming DiLoCo), so every module is synced every K rounds and a path's last task syncs all; the islands train on the modules not synced; 1 = every module every round


@dataclass(kw_only=True)
class RoundsConfig(Section):
    """When a round closes: every path (sync), or per module a quorum and a grace window while islands go on (async)."""

    section = "rounds"
    mode: Literal["sync", "async"] = "sync"  # sync: a round waits for every path | async: islands never wait; a round closes on a quorum + grace window, stale results down-weighted
    quorum: Annotated[float, Range(above=0, max=1)] = 0.5  # async: fraction of a module's paths that must report before its round can close
    grace_fraction: NonNegative = 0.25  # async: after the quorum, wait for the results expected within this fraction of the median task time
    grace_seconds: NonNegative = 600.0  # async: the grace window's upper bound (and its length before any task time is measured)
    staleness_power: NonNegative = 0.0  # async: a result s versions stale is weighted by (1 + s) ** -staleness_power; 0 = not at all (islands overlap the commit, so most results are one version behind)
    max_staleness: Count = 4  # async: results more than this many versions behind are dropped (a running task that has run a median task time is cut one version before; one that could only be dropped is cancelled)
    cut_after: Annotated[float, Range(min=1, off=0)] = 1.5  # async: a running task past this many median task times is cut (it reports the steps it trained), so its path moves on; 0 = never
    move_margin: Annotated[float, Range(min=0.1, off=0)] = 1.0  # async: an island slower than the other islands' median speed by more than this fraction (1.0: half their speed) gets its path taken by a faster island at a task boundary, and takes the path furthest ahead (paths rotate through it); 0 = paths never move (`dipaco.rounds.moves`)


@dataclass(kw_only=True)
class CompressionConfig(Section):
    """How pseudo-gradients and module updates travel: an island's upload, and what it downloads to reach a newer version."""

    section = "compression"
    codec: Literal[CODECS] = "none"  # one of `dipaco.codec.registry`'s names: none (float32) | int8 | int4 (per-row scales) | topk (per chunk the largest-magnitude `density`, at `bits` bits), then zstd
    zstd_level: Annotated[int, Range(min=1, max=22)] = 1  # zstd level of compressed pseudo-gradients
    density: Annotated[float, Range(above=0, max=1)] = 0.03  # topk: fraction of each chunk's entries sent (SparseLoCo: 0.01-0.03)
    bits: Literal[2, 4, 8] = 2  # topk: bits per sent value, one of them its sign (2: the sign and the chunk's smallest or largest sent magnitude)
    chunk: Annotated[int, Range(min=64, max=65536)] = 4096  # topk: elements per chunk of a flattened tensor; each chunk keeps its own top entries
    error_feedback: bool = True  # topk: what was not sent is added to the path's next pseudo-gradient (the residual is kept in the path's carried state)
    ef_decay: Annotated[float, Range(above=0, max=1)] = 1.0  # error feedback: beta of the accumulator e = beta * e + delta, whose top-k is sent and decoded value subtracted (SparseLoCo); 1 = the residual carried whole. Below 1 the accumulator takes the outer momentum's place (ef_with_momentum)
    last_task: Literal["float32", "int8", "codec"] = "float32"  # the codec of the path's last pseudo-gradient, which holds its error-feedback residual and the drift of modules not sent before (with outer.private_modules local: the whole training of its private modules): float32 = nothing it trained stays on the island | int8 = a quarter of that, per-row rounding | codec = compression.codec like every task
    ef_with_momentum: bool = False  # with ef_decay < 1: the outer step keeps outer.momentum too; false = no outer momentum, a plain step of outer.lr on the average (SparseLoCo). Matters where the outer step has momentum: outer.decay keep, or rounds before the inner lr's decay
    download: Literal["update", "full", "results"] = "update"  # what an island fetches to reach a newer version of a module it holds: the published update (encoded with codec and its settings; version v+1 := v - d, dipaco.codec.update), the whole module, or the round's results themselves where the outer step is a plain average (the other islands' encoded contributions, as SparseLoCo's all-gather; v+1 := v - sum w_i d_i, dipaco.codec.contributions; other rounds: the update)

    @property
    def feeds_back(self) -> bool:
        """Whether islands carry an error-feedback residual: `codec: topk` with `error_feedback`."""
        return self.codec == "topk" and self.error_feedback

    @property
    def replaces_momentum(self) -> bool:
        """Whether the error-feedback accumulator takes the outer momentum's place: `ef_decay` < 1 without
        `ef_with_momentum` (SparseLoCo)."""
        return self.ef_decay < 1 and not self.ef_with_momentum

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ef_decay < 1 and not self.feeds_back:
            raise ValueError(f"compression.ef_decay {self.ef_decay} decays the error-feedback accumulator, but codec "
                             f"{self.codec!r} with error_feedback {self.error_feedback} carries none: set "
                             "compression.codec: topk and compression.error_feedback: true, or ef_decay: 1")


@dataclass(kw_only=True)
class RunConfig(Section):
    """The run's length and what it records."""

    section = "run"
    rounds: PositiveInt = 10  # the planned training: every path has this many results of inner.steps steps applied (in every mode; sync commits one version per round)
    stop_after_round: Count = 0  # 0 = train the whole run; else stop after this module version (the lr schedule still spans run.rounds), e.g. to re-route midway
    seed: Seed = 0  # model initialisation and data order
    tensorboard: bool = True  # the coordinator writes per-round metrics as TensorBoard event files in <run>/tensorboard/


@dataclass(kw_only=True)
class HardwareConfig(Section):
    """Where and how this machine computes: training, the baselines and evaluation alike."""

    section = "hardware"
    device: Device = "auto"  # auto (cuda when available) | cpu | cuda
    precision: Precision = "auto"  # auto (bf16 where the device computes it natively, else fp32) | fp32 | bf16 (autocast)
    islands: Count = 0  # island processes run at once on this machine; 0 = min(paths, CPU cores)
    threads_per_island: Count = 0  # threads (torch, faiss, BLAS) per island process and of pretrain, route, reroute and eval; 0 = cores // islands for islands, the default elsewhere
    compile: bool = False  # torch.compile each island's path model, once per island process (docs/islands.md#speed)
    tf32: bool = False  # on CUDA, fp32 matmuls on TF32 tensor cores (Ampere and later; matters with precision fp32)
    workers_per_island: PositiveInt = 1  # worker processes per island; above 1 an elastic island (CPU, torchft: pip install 'dipaco[elastic]'): the workers split each batch, and the island goes on when one dies (docs/islands.md#elastic-islands)


@dataclass(kw_only=True)
class StoreConfig(Section):
    """The module store, the only medium between islands, and the shard cache of store-only machines."""

    section = "store"
    url: str = ""  # fsspec URL of the module store; "" = <run>/store (s3://, gs://, NFS for clusters)
    keep_versions: Count = 2  # module versions kept in the store (older ones are deleted); 0 = keep all
    cache_dir: str = ""  # where a store-only island or coordinator (--store URL) caches the shards it downloads; "" = $XDG_CACHE_HOME/dipaco or ~/.cache/dipaco
    cache_max_bytes: Count = 10 * 2**30  # that cache's size: least recently used shards are deleted beyond it; 0 = no limit


@dataclass(kw_only=True)
class ResilienceConfig(Section):
    """How the run survives islands and coordinators that stop, stall or send bad results."""

    section = "resilience"
    heartbeat_seconds: Positive = 1.0  # how often an island writes its heartbeat file
    heartbeat_timeout: Positive = 30.0  # a task whose island has not heart-beaten for this long is handed to another
    lease_timeout: Positive = 60.0  # a coordinator's store lease not renewed for this long may be taken over (docs/islands.md#crash-safety)
    checkpoint_steps: Count = 0  # islands save their task's inner state locally every this many inner steps (a restart resumes); 0 = never
    inner_checkpoint_every: Count = 0  # upload a path's carried state (moments, residual, drift) every this many of its tasks, moments in bf16, for a path moved after a crash to resume from; 0 = only on hand-offs and its last task (a moved path starts fresh moments: as good on tiny, experiments/results/carried-move.md)
    max_norm_ratio: Annotated[float, Range(above=1, off=0)] = 50.0  # reject a result whose pseudo-gradient norm exceeds this times the median of its path's accepted norms; 0 = off
    max_update_ratio: Annotated[float, Range(above=0, off=0)] = 1.0  # sanity bound: reject a result that would move one of its modules by more than this times the module's norm at the version it started from (a path's first result too); 0 = off
    max_update_scale: Annotated[float, Range(above=1, off=0)] = 4.0  # poison bound: reject a result that moves a module more than this times the median of what honest results move modules of its role, per unit of lr and module norm (docs/islands.md#poison); 0 = off
    hold_seconds: NonNegative = 300.0  # a result whose modules' roles have no honest result to compare with yet waits this long for another path's (then only max_update_ratio bounds it)
    max_carried_ratio: Annotated[float, Range(above=0, off=0)] = 100.0  # reject an inner state whose error-feedback residual or drift has a norm above this times the largest of its path's accepted pseudo-gradient norms; 0 = off
    max_rejections: PositiveInt = 3  # stop the run when one task's results are rejected this many times
    worker_join_seconds: Positive = 10.0  # an elastic island's quorum forms without a live worker that is not there this long after the first asked (its lighthouse's join timeout; above a try and a heal, or a late worker is left out round after round)
    worker_lost_seconds: Annotated[float, Range(above=0.2)] = 1.0  # an elastic island's lighthouse counts a worker gone this long after its last heartbeat (torchft's heartbeat_timeout_ms; workers beat every 0.1 s): the island's longest pause when a worker dies

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heartbeat_timeout <= self.heartbeat_seconds:
            raise ValueError(f"resilience.heartbeat_timeout {self.heartbeat_timeout} must exceed "
                             f"resilience.heartbeat_seconds {self.heartbeat_seconds}")


@dataclass(kw_only=True)
class FaultsConfig(Section):
    """Fault injection for local islands (`dipaco train`): failures, returns, a slow island, a pace, a slow link."""

    section = "faults"
    mtbf: NonNegative = 0.0  # islands fail at random with this mean time between failures (s); 0 = never
    return_after: NonNegative = 10.0  # a failed island comes back after this many seconds
    mode: Literal["die", "stall"] = "die"  # die (the task is lost) | stall (stop heart-beating, then finish late)
    slowdown: Annotated[float, Range(min=1)] = 1.0  # island-0 of `dipaco train` (or an island run with --slowdown) is this many times slower
    store_bandwidth: NonNegative = 0.0  # emulate a slow link: each island's store reads and writes take their bytes / this many bytes per second, each way (dipaco.store.bandwidth: a fair-shared full-duplex link; benchmarks); 0 = unlimited
    step_seconds: NonNegative = 0.0  # pad every island's inner steps to this wall time by sleeping (benchmarks: islands paced as on machines of their own; slowdown then multiplies it); 0 = off


@dataclass(kw_only=True)
class LauncherConfig(Section):
    """Who starts the coordinator and the islands of `dipaco train`: processes here, or Ray tasks."""

    section = "launcher"
    kind: Literal["local", "ray"] = "local"  # local (processes on this machine) | ray (docs/islands.md#clusters)
    ray_address: str = ""  # ray.init(address=...); "" = start a local Ray instance, "auto" = the running cluster, or host:port / ray://host:10001
    ray_island_cpus: PositiveInt = 1  # CPUs each island asks Ray for (also its torch threads)
    ray_island_gpus: NonNegative = 0.0  # GPUs each island asks Ray for (set it with hardware.device cuda)
    ray_coordinator_cpus: NonNegative = 1.0  # CPUs the coordinator task asks Ray for
    ray_island_restarts: Count = 3  # times Ray starts an island again whose process or node died


@dataclass(kw_only=True)
class EvalConfig(Section):
    """Routed evaluation and the dense baselines it is compared with."""

    section = "eval"
    batch_size: PositiveInt = 16  # sequences per evaluation forward pass
    baselines: bool = True  # train dense 1x1 baselines at equal steps and at equal compute
    baselines_init: Literal["warm-start", "scratch"] = "warm-start"  # path-sized baselines continue from the dense warm start (as in the papers) or start from scratch
    baselines_with_train: bool = True  # `dipaco run` trains the baselines alongside the islands (they share the cores)
    modes: list[str] = field(default_factory=lambda: ["prefix", "every:64", "likelihood", "oracle", "oracle-split", "all-paths"])  # prefix / likelihood / likelihood:K (among the router's K best paths) / oracle / oracle-split / all-paths / every:W (dipaco.eval.modes)
    best: bool = False  # also evaluate each path at its best round by validation loss (early stopping)
    large_hidden_size: Count = 0  # width of the "dense-large" baseline; 0 = no such baseline
    large_n_layers: Count = 0  # blocks of "dense-large"; 0 = model.n_layers (its heads keep a path's head size)

    def __post_init__(self) -> None:
        super().__post_init__()
        for mode in self.modes:
            try:
                parse_mode(mode)
            except ValueError as err:
                raise ValueError(f"eval.modes: {err}") from None


@dataclass(kw_only=True)
class SimulateConfig(Section):
    """`dipaco simulate`: the simulated cluster, its failures and its workload (docs/simulate.md)."""

    section = "simulate"
    learners: PositiveInt = 8  # DiLoCo learners (islands), each a data-parallel group of chips_per_learner chips
    chips_per_learner: PositiveInt = 150_000  # chips in one learner; data parallel runs on learners x this many
    chip_mtbi_hours: Positive = 8766.0  # mean time between interruptions of one chip (8766 h = 1 year)
    restart_seconds: NonNegative = 30.5  # a stopped job or learner is back this long after its last chip failure
    reconfigure_seconds: NonNegative = 6.8  # elastic: every chip of the group pauses this long when a chip leaves or returns
    learner_failure: Literal["elastic", "restart"] = "elastic"  # what a learner does on a chip failure: elastic (shrink, go on) | restart
    checkpoint_interval: PositiveInt = 5  # a restarted job resumes from its last checkpoint, taken every this many steps
    step_seconds: Positive = 2.0  # one training step (inner step) on any group of chips
    speed_sigma: NonNegative = 0.05  # log-normal sigma of a learner's speed per task (stragglers); 0 = identical speeds
    model_parameters: Annotated[int, Range(min=1)] = 12_000_000_000  # parameters of the model (for the bytes each strategy moves)
    parameter_bytes: Positive = 2.0  # bytes per parameter of gradients (data parallel) and downloaded modules
    link_gbit_per_s: Positive = 100.0  # each learner's link to the others / the syncer; sync rounds wait for the transfer
    horizon_hours: Positive = 24.0  # simulated wall-clock time of each run
    seed: Seed = 0  # failure times and speeds (numpy)
    sweep_chips: list[PositiveInt] = field(default_factory=lambda: [150_000, 300_000, 600_000, 1_200_000, 2_400_000])  # total chips of the goodput-vs-chips plot
    sweep_learners: list[PositiveInt] = field(default_factory=lambda: [1, 2, 8, 16])  # learner counts of the plot (async rounds)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("sweep_chips", "sweep_learners"):
            if not getattr(self, name):
                raise ValueError(f"simulate.{name} must be a non-empty list of ints >= 1, got []")


@dataclass(kw_only=True)
class Config:
    """The whole run: one section per concern, in pipeline order."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    run: RunConfig = field(default_factory=RunConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reroute: RerouteConfig = field(default_factory=RerouteConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)

    def __post_init__(self) -> None:
        blocks, n_layers, levels = self.topology.blocks_per_level, self.model.n_layers, self.topology.levels
        if blocks and sum(blocks) != n_layers:
            raise ValueError(f"topology.blocks_per_level {blocks} sums to {sum(blocks)}, but model.n_layers is {n_layers}")
        if not blocks and n_layers < len(levels):
            raise ValueError(f"model.n_layers {n_layers} is fewer than the {len(levels)} levels of topology.levels {levels}")
        bad = [b for b in self.topology.private_blocks if b >= n_layers]
        if bad:
            raise ValueError(f"topology.private_blocks {bad} are outside the model's blocks 0..{n_layers - 1}")
        head = self.model.hidden_size // self.model.n_heads
        if self.eval.large_hidden_size % head:
            raise ValueError(f"eval.large_hidden_size {self.eval.large_hidden_size} is not a multiple of a path's "
                             f"head size {head} (model.hidden_size / model.n_heads)")
        if self.outer.decay != "keep" and self.inner.schedule != "wsd":
            raise ValueError(f"outer.decay {self.outer.decay!r} plain-averages the rounds in inner.schedule wsd's "
                             f"decay; with inner.schedule {self.inner.schedule!r} set outer.decay: keep")
        plain = self.outer.decay == "average" or (self.outer.lr == 1.0 and self.outer.momentum == 0.0)
        if self.outer.private_modules == "local" and not plain:
            raise ValueError(f"outer.private_modules 'local' sends a private module's whole training in the path's last "
                             f"task, which must be applied as it is (a plain average of one), but outer.decay "
                             f"{self.outer.decay!r} applies the outer step (lr {self.outer.lr}, momentum "
                             f"{self.outer.momentum}) to it: set outer.decay: average (or lr 1 and momentum 0), or outer.private_modules: synced")
        if self.routing.featurizer == "base-model" and self.warm_start.fraction == 0:
            raise ValueError("routing.featurizer 'base-model' routes on the warm start's features, but "
                             "warm_start.fraction is 0 (no warm start): set routing.featurizer: tfidf, or a warm start")
        if self.routing.router == "learned" and (self.corpus.router_fraction == 0 or self.topology.replicas > 1):
            raise ValueError(f"routing.router 'learned' is fitted on the router split's losses: it needs "
                             f"corpus.router_fraction > 0 (got {self.corpus.router_fraction}) and topology.replicas 1 "
                             f"(got {self.topology.replicas})")
        if self.routing.router == "learned" and self.reroute.phases > self.run.rounds:
            raise ValueError(f"reroute.phases {self.reroute.phases} is more discriminative phases than run.rounds "
                             f"{self.run.rounds} (one at most after each round)")
        if self.routing.prefix_tokens >= self.sharding.seq_len:
            raise ValueError(f"routing.prefix_tokens {self.routing.prefix_tokens} leaves nothing to score in "
                             f"sequences of sharding.seq_len {self.sharding.seq_len}")

    @property
    def outer_step(self) -> OuterConfig:
        """The outer step the coordinator runs: `outer`, without momentum (`momentum` 0, no Nesterov) when the
        error-feedback accumulator takes its place (`compression.replaces_momentum`, SparseLoCo)."""
        if self.compression.replaces_momentum:
            return dataclasses.replace(self.outer, momentum=0.0, nesterov=False)
        return self.outer

    @property
    def pretrain_steps(self) -> int:
        """The dense warm start's steps (`dipaco pretrain`): warm_start.fraction of the run's path-model steps
        (the warm start's and the paths' together), 0 without a warm start."""
        fraction = self.warm_start.fraction
        path_steps = math.prod(self.topology.levels) * self.topology.replicas * self.run.rounds * self.inner.steps
        return round(fraction / (1 - fraction) * path_steps)

    @property
    def warm_start_steps(self) -> int:
        """The warm-start steps every path continues from (its step count and lr schedule go on from them):
        `pretrain_steps`, or 0 when the modules do not start from the warm start."""
        return self.pretrain_steps if self.warm_start.init_modules else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Build a Config from a YAML file (or the defaults) and `section.key=value` overrides."""
    raw, source = read_raw(path, overrides or [])
    return build_config(Config, raw, source=source)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically), so islands and later stages read the same values; a
    file that already holds them is left as it is (not even its mtime changes)."""
    import yaml

    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    if os.path.isfile(path) and Path(path).read_text() == text:
        return
    write_text(path, text)
