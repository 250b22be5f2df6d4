"""The dense warm start (DiPaCo §7.3: every path starts from a dense model pretrained for 24k steps).

    dipaco pretrain --config configs/demo.yaml --run runs/d warm_start.fraction=0.25

Runs before routing, so it makes what it needs itself: the run's tokenizer (trained on the training
documents, as `dipaco route` would, which then reuses it), and one all-documents shard set in
`<run>/pretrain/shards` (every training document on a single path). It trains one path-shaped dense
model for `Config.pretrain_steps` AdamW steps (`warm_start.fraction` of the run) (`dipaco.optim.dense.train_dense`: the inner recipe, schedule
stretched over those steps; under `inner.schedule: wsd` warmup then the constant lr, no decay) and saves it twice: `pretrain/model.safetensors` (path parameters:
`dipaco train` initialises every module of the grid from it when `warm_start.init_modules`) and
`pretrain/hf/` (a `save_pretrained` directory with the tokenizer: the `base-model` routing
featurizer mean-pools its last hidden states over the first `routing.prefix_tokens` tokens), with its
AdamW state in `pretrain/optimizer.safetensors` (what the paths and baselines continue with
`warm_start.continue_optimizer`). A `summary.json` records steps, tokens, losses, seconds and the schedule.
`pretrain/hf/` is written last, under a temporary name renamed into place: `dipaco run` takes the warm start
as done only when it is there.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile

import numpy as np

from dipaco.config import Config, save_config
from dipaco.device import resolve_device
from dipaco.optim.dense import train_dense
from dipaco.optim.inner import warm_start_total
from dipaco.pipeline.context import PathFactory, path_spec
from dipaco.pipeline.documents import load_run_corpus, run_splits, run_tokenizer
from dipaco.run_dir import RunDir
from dipaco.threads import use_threads
from routing.corpus import TRAIN
from sharding.build import build_shards
from sharding.reader import ShardReader

log = logging.getLogger(__name__)


def pretrain(config: Config, run: RunDir) -> dict:
    """Train the dense warm-start model; returns its summary."""
    if config.pretrain_steps < 1:
        raise ValueError(f"warm_start.fraction is {config.warm_start.fraction}: no warm start to train; set it above 0 (e.g. 0.5)")
    use_threads(config.hardware.threads_per_island)
    save_config(config, run.config)
    out = run.pretrain
    dataset = load_run_corpus(config.corpus)
    split = run_splits(config.corpus, len(dataset))
    texts = dataset["text"]
    tokenizer = run_tokenizer(config.sharding, run, [t for t, s in zip(texts, split) if s == TRAIN])
    shards = out / "shards"
    if not (shards / "index.json").exists():
        build_shards(texts=texts, doc_ids=np.asarray(dataset["doc_id"], dtype=np.int64),
                     doc_paths=np.zeros(len(texts), dtype=np.int64), doc_split=split, n_paths=1,
                     tokenizer=tokenizer, config=config.sharding, out_dir=shards,
                     router_fingerprint="pretrain: all training documents on one path",
                     min_test_tokens=PathFactory(config, run).prefix_tokens + 1, overwrite=True)
    spec = path_spec(config, tokenizer)
    batches = ShardReader(shards).iter_batches(0, "train", batch_size=config.inner.batch_size, seed=config.run.seed)
    log.info("pretraining the dense warm start for %d steps", config.pretrain_steps)
    model, summary = train_dense(spec, batches, steps=config.pretrain_steps, inner=config.inner,
                                 seed=config.run.seed, device=resolve_device(config.hardware.device),
                                 precision=config.hardware.precision, out=out,
                                 schedule=(0, warm_start_total(config.inner, config.pretrain_steps)),
                                 save_optimizer=True)
    hf = out / "hf"  # written last, whole or not at all: with summary.json it says the warm start is done
    shutil.rmtree(hf, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=".hf.tmp-", dir=out)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, hf)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    summary = pretrain(config, run)
    print(f"dense warm start: {summary['steps']} steps, {summary['tokens']:,} tokens, final train loss "
          f"{summary['final_train_loss']:.3f}, {summary['seconds']:.0f}s")
