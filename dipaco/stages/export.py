"""Trained paths as ordinary Hugging Face models, and the whole mixture as one directory (`dipaco export`).

    dipaco export out/demo  --run runs/demo                # the mixture as a Hugging Face repository
    dipaco export out/demo  --run runs/demo --per-path     # ... and each path as its own directory (path-0003/)
    dipaco export out/demo  --run runs/demo --baselines    # ... and the dense baselines (baselines/<name>/)
    dipaco export out/path3 --run runs/demo --path 3       # one path: config.json, model.safetensors, tokenizer

The mixture directory is a Hugging Face repository (`dipaco.inference.hub_repo`): config.json with an
`auto_map` to the modeling files shipped in it (torch and transformers only), every module once in
sharded safetensors, the tokenizer and a model card (README.md), so it loads without dipaco:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out/demo", trust_remote_code=True)   # routes each sequence
    tok = AutoTokenizer.from_pretrained("out/demo")

It is also self-describing for dipaco (`dipaco_mixture.json`, `dipaco.inference.manifest`) and loads with
`dipaco.load(DIR)`, which routes each prompt to one path (`dipaco.inference.mixture`); `--route
likelihood` makes likelihood routing the mixture's default (a caller can still choose either at load).
The router's featurizer model (`base-model`, `hf`) is copied in, so the directory stands alone. Paths
are the routed paths (with DiLoCo replicas the first replica, the one evaluation loads).

`--round R` exports module version R (default the last), `--best` each path's best version by
validation loss (dipaco.eval.early_stopping). `--all` is the mixture (the default; it was once its own
layout with `paths.json`, now `dipaco_mixture.json`). A directory is written whole under a hidden
temporary sibling, then renamed over `out`, so a reader never sees half an export (`dipaco.outputs`):
`out` must be new, empty, or an earlier export (with `--overwrite`), and outside the run directory;
nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from dipaco.atomic import write_json
from dipaco.config import Config
from dipaco.inference.hub_repo import (
    SHARD_BYTES,
    clean_tokenizer,
    grid_name,
    hub_router,
    llama_dict,
    normal_permissions,
    patch_path_config,
    write_hub_config,
    write_weights,
)
from dipaco.inference.manifest import MANIFEST, Manifest, PathEntry, pickled_files, write_manifest
from dipaco.inference.model_card import CardFacts, model_card
from dipaco.model.path_model import count_parameters, llama_config
from dipaco.model.topology import Topology
from dipaco.outputs import output_dir
from dipaco.pipeline.context import PathFactory, chosen_versions
from dipaco.run_dir import RunDir

log = logging.getLogger(__name__)

def export_path(factory: PathFactory, *, path: int, round: int, out: str | os.PathLike,
                overwrite: bool = False) -> Path:
    """Write path `path` at module version `round` as a Hugging Face model directory `out`."""
    with output_dir(out, overwrite=overwrite, protected=_protected(factory), what="dipaco export") as tmp:
        _write_path(factory, path=path, round=round, out=tmp)
        normal_permissions(tmp)
    log.info("exported path %d (round %d) to %s", path, round, out)
    return Path(out)


def _write_path(factory: PathFactory, *, path: int, round: int, out: Path) -> None:
    model = factory.load_path(path=path, round=round)
    model.config.use_cache = True  # generation reuses past keys and values
    model.save_pretrained(out, safe_serialization=True)
    patch_path_config(out)
    factory.tokenizer.save_pretrained(out)
    clean_tokenizer(out, max_length=factory.config.sharding.seq_len)
    topology = factory.topology
    info = {"path": path, "choice": topology.path_label(path), "round": round,
            "modules": topology.modules_of_path(path), "levels": list(topology.levels),
            "prefix_tokens": factory.prefix_tokens}
    write_json(out / "dipaco_path.json", info)


def export_mixture(factory: PathFactory, *, rounds: dict[int, int], out: str | os.PathLike, route: str = "router",
                   baselines: bool = False, per_path: bool = False, overwrite: bool = False,
                   shard_bytes: int = SHARD_BYTES) -> Path:
    """The whole mixture in `out` as a Hugging Face repository (`dipaco.inference.hub_repo`): every module
    once in the shards, config.json and the modeling files, the tokenizer, the model card, the router
    (`router/`, its featurizer's model in `featurizer/`) and `dipaco_mixture.json`; with `per_path`, each
    routed path as its own directory too (`path-0003/`), with `baselines` the dense baselines (`baselines/`)."""
    topology = factory.topology
    paths = [topology.representative(q) for q in range(topology.n_routed)]
    stored = stored_names(topology, paths, rounds)
    with output_dir(out, overwrite=overwrite, protected=_protected(factory), what="dipaco export") as tmp:
        router = factory.router
        description, router_tensors, fallback = hub_router(router)
        if fallback:
            log.warning("the modeling file routes by likelihood: the router cannot be computed without dipaco (%s)",
                        fallback)
        weights = write_weights(tmp, _weights(factory, rounds, stored, router_tensors), shard_bytes=shard_bytes)
        router.save(tmp / "router")
        featurizer = _copy_featurizer_model(router.featurizer, tmp / "featurizer")
        factory.tokenizer.save_pretrained(tmp)
        clean_tokenizer(tmp, max_length=factory.config.sharding.seq_len)
        modules = {p: {m: stored[m, rounds[p]] for m in topology.modules_of_path(p)} for p in paths}
        _write_config(factory, tmp, modules=modules, route="likelihood" if fallback else route, router=description,
                      fallback=fallback)
        if per_path:
            for path in paths:
                _write_path(factory, path=path, round=rounds[path], out=tmp / f"path-{path:04d}")
        if baselines:
            _write_baselines(factory, tmp / "baselines")
        manifest = Manifest(
            levels=list(topology.levels), replicas=topology.replicas, prefix_tokens=factory.prefix_tokens,
            max_length=factory.config.sharding.seq_len, tokenizer=".", router="router",
            featurizer=featurizer, route=route,
            paths={p: PathEntry(dir=f"path-{p:04d}" if per_path else None, choice=list(topology.choice(p)),
                                round=rounds[p], modules=modules[p]) for p in paths})
        write_manifest(tmp, manifest)
        (tmp / "README.md").write_text(_card(factory, out, rounds={p: rounds[p] for p in paths}, route=route,
                                             n_modules=len(set(stored.values())), fallback=fallback))
        normal_permissions(tmp)
    log.info("exported the mixture (%d paths, %d modules, %d tensors) to %s", len(paths), len(set(stored.values())),
             len(weights), out)
    return Path(out)


def stored_names(topology: Topology, paths: list[int], rounds: dict[int, int]) -> dict[tuple[str, int], str]:
    """The name each (module, version) the paths use is stored under: the module's own, or `<module>-v<R>`
    when paths use the module at different versions (`--best`)."""
    versions: dict[str, set[int]] = {}
    for path in paths:
        for module in topology.modules_of_path(path):
            versions.setdefault(module, set()).add(rounds[path])
    return {(m, r): m if len(rs) == 1 else f"{m}-v{r}" for m, rs in versions.items() for r in rs}


def _weights(factory: PathFactory, rounds: dict[int, int], stored: dict[tuple[str, int], str],
             router_tensors: dict[str, np.ndarray]):
    """(name, tensor) of every stored module's parameters, read one module at a time, then the router's."""
    for (module, round), name in sorted(stored.items(), key=lambda item: item[1]):
        for param, tensor in factory.store.read_module(round, module).items():
            yield grid_name(name, param), tensor
    for name, array in sorted(router_tensors.items()):
        yield f"router.{name}", torch.from_numpy(np.ascontiguousarray(array))


def _write_config(factory: PathFactory, out: Path, *, modules: dict[int, dict[str, str]], route: str,
                  router: dict | None, fallback: str | None) -> None:
    spec, topology = factory.spec, factory.topology
    llama = llama_dict(llama_config(spec.model, vocab_size=spec.vocab_size, seq_len=spec.seq_len,
                                    eos_id=spec.eos_id, pad_id=spec.pad_id))
    llama["use_cache"] = True
    write_hub_config(out, llama=llama, levels=list(topology.levels), replicas=topology.replicas,
                     level_blocks=[list(b) for b in topology.level_blocks],
                     private_blocks=sorted(topology.private_blocks), private_embeddings=topology.private_embeddings,
                     paths={str(p): m for p, m in modules.items()}, route=route, prefix_tokens=factory.prefix_tokens,
                     router=router, router_fallback=fallback, max_length=factory.config.sharding.seq_len)


def _card(factory: PathFactory, out: str | os.PathLike, *, rounds: dict[int, int], route: str, n_modules: int,
          fallback: str | None) -> str:
    results = factory.run.eval_results
    eval_results = json.loads(results.read_text()) if results.is_file() else None
    facts = CardFacts(name=Path(out).name, corpus=factory.config.corpus.path, levels=list(factory.topology.levels),
                      n_paths=len(rounds), modules=n_modules, params_per_path=count_parameters(factory.new_model()),
                      prefix_tokens=factory.prefix_tokens, max_length=factory.config.sharding.seq_len, route=route,
                      featurizer=factory.config.routing.featurizer, rounds=rounds, fallback=fallback)
    return model_card(facts, eval_results=eval_results)


def _copy_featurizer_model(featurizer, out: Path) -> str | None:
    """Copy the router's featurizer model into `out` (None for a featurizer without one: TF-IDF); its
    pickled weight files are refused, since loading them would unpickle."""
    source = getattr(featurizer, "location", None)
    if source is None:
        return None
    files = [f for f in Path(source).iterdir() if f.is_file()]
    pickled = pickled_files(Path(source))
    if pickled:
        raise ValueError(f"the router's featurizer model {source} has pickled weight files {pickled}; an export "
                         f"holds safetensors only: save that model with safe_serialization and route again")
    out.mkdir()
    for file in files:
        shutil.copy2(file, out / file.name)
    return out.name


def _write_baselines(factory: PathFactory, out: Path) -> None:
    """Each trained dense baseline of the run as a Hugging Face directory `out/<name>/`."""
    from dipaco.optim.dense import load_dense

    root = factory.run.baselines
    folders = sorted(d for d in root.iterdir() if (d / "summary.json").is_file()) if root.is_dir() else []
    if not folders:
        raise ValueError(f"--baselines: {root} holds no trained baseline; run `dipaco baselines` first")
    for folder in folders:
        model, _ = load_dense(folder, factory.spec)
        model.config.use_cache = True
        model.save_pretrained(out / folder.name, safe_serialization=True)
        patch_path_config(out / folder.name)
        factory.tokenizer.save_pretrained(out / folder.name)
        clean_tokenizer(out / folder.name, max_length=factory.config.sharding.seq_len)
        log.info("exported baseline %s", folder.name)


def _protected(factory: PathFactory) -> list[Path]:
    """What an export must not write into: the run directory (and a local store elsewhere)."""
    areas = [factory.run.root]
    if factory.store.is_local:
        areas.append(Path(factory.store.root))
    return areas


def command(config: Config, run: RunDir, args: argparse.Namespace) -> None:
    factory = PathFactory(config, run)
    rounds = chosen_versions(factory, round=args.round, best=args.best)
    if args.path is None:
        if args.all:
            log.info("--all: the whole mixture is what `dipaco export DIR` writes; its index is now %s", MANIFEST)
        out = export_mixture(factory, rounds=rounds, out=args.out, route=args.route, baselines=args.baselines,
                             per_path=getattr(args, "per_path", False), overwrite=args.overwrite)
        print(f"exported the mixture ({factory.topology.n_routed} paths, the router and the tokenizer) to {out}; "
              f"load it with dipaco.load({str(out)!r}) or AutoModelForCausalLM.from_pretrained({str(out)!r}, "
              f"trust_remote_code=True)")
        return
    if args.baselines or args.route != "router" or getattr(args, "per_path", False):
        raise ValueError("--baselines, --route and --per-path go with the whole mixture, not with --path")
    if not 0 <= args.path < factory.topology.n_paths:
        raise ValueError(f"--path {args.path} is outside 0..{factory.topology.n_paths - 1}")
    out = export_path(factory, path=args.path, round=rounds[args.path], out=args.out, overwrite=args.overwrite)
    print(f"exported path {args.path} (round {rounds[args.path]}) to {out}; "
          f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
