"""Config drift refused: what each stage's artifacts were made from, recorded and checked.

    record(run, "route", config, corpus=corpus_digest(config.corpus))   # after route wrote its artifacts
    check(run, config, ("route", "shard"))   # before a stage that reads them: raises DriftError on a mismatch

A stage's record (`routing/fingerprint.json`, `shards/fingerprint.json`, `train-fingerprint.json`) holds
the values of the config keys that stage depends on (`STAGE_KEYS`, the one dependency table) and the
fingerprints of its inputs:

    route   corpus.*, routing.* (but the batch size and routing.router), sharding.tokenizer,
            sharding.vocab_size, topology.levels / replicas; input: every corpus file (size, mtime, sha256)
    shard   sharding.seq_len / val_fraction / tokens_per_shard / seed, routing.prefix_tokens,
            topology.levels / replicas; input: the router it packed for (index.json's router fingerprint,
            checked against routing/router.json even in runs made before records existed)
    train   model.*, topology.*, sharding.seq_len; input: sha256 of shards/index.json

Checking a stage compares its record with the current config and inputs; any difference stops with the
keys that differ (old → new) and the ways out: set them back and keep the run, a new run directory, or
`dipaco run --restart-from STAGE` (the stale artifacts are moved to `superseded/`). Keys not listed (eval.*, inner.*, run.rounds, ...)
never trigger it. Runs made before records existed are accepted with a warning.
"""

from __future__ import annotations

import glob
import json
import logging
from pathlib import Path
from typing import Any

from dipaco.atomic import write_text
from dipaco.config import Config
from dipaco.run_dir import RunDir
from routing.routing_config import CorpusConfig

log = logging.getLogger(__name__)

STAGE_ORDER = ("pretrain", "route", "shard", "train", "baselines", "eval", "report")  # `dipaco run`'s order

# stage → the config keys its artifacts depend on ("section" = every key of it, "-section.key" = but that one)
STAGE_KEYS: dict[str, tuple[str, ...]] = {
    "route": ("corpus", "routing", "-routing.hf_batch_size", "-routing.router", "sharding.tokenizer",
              "sharding.vocab_size", "topology.levels", "topology.replicas"),
    "shard": ("sharding.seq_len", "sharding.val_fraction", "sharding.tokens_per_shard", "sharding.seed",
              "routing.prefix_tokens", "topology.levels", "topology.replicas"),
    "train": ("model", "topology", "sharding.seq_len"),
}

# stage → the artifacts (and the command that redoes them) it names in messages
MADE_BY = {"route": "routing/ and tokenizer/", "shard": "shards/", "train": "the module store and train.json"}


def file_sha256(path: Path) -> str:
    """`dipaco.store.publish.file_sha256`, imported on use: the store imports torch, and `dipaco --help` reads
    `STAGE_ORDER` from here."""
    from dipaco.store.publish import file_sha256 as sha256

    return sha256(path)


class DriftError(ValueError):
    """A stage's upstream artifacts were made from other config values or inputs than the current ones."""


def record_path(run: RunDir, stage: str) -> Path:
    return {"route": run.routing / "fingerprint.json", "shard": run.shards / "fingerprint.json",
            "train": run.root / "train-fingerprint.json"}[stage]


def stage_values(config: Config, stage: str) -> dict[str, Any]:
    """The values of `STAGE_KEYS[stage]` in `config`, as flat `section.key` → value."""
    tree = config.to_dict()
    values: dict[str, Any] = {}
    for spec in STAGE_KEYS[stage]:
        if spec.startswith("-"):
            values.pop(spec[1:], None)
            continue
        section, _, key = spec.partition(".")
        keys = [key] if key else list(tree[section])
        values.update({f"{section}.{k}": tree[section][k] for k in keys})
    return values


def corpus_files(corpus: CorpusConfig) -> list[Path]:
    """The local files the corpus is read from ([] for a Hugging Face hub dataset name)."""
    from dipaco.pipeline.documents import corpus_location  # (imports datasets: not at `dipaco --help`)

    location = corpus_location(corpus)
    path = Path(location)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    return sorted(Path(p) for p in glob.glob(location) if Path(p).is_file())


def corpus_digest(corpus: CorpusConfig) -> dict[str, dict]:
    """Every corpus file's size, mtime and sha256 (keyed by path)."""
    out = {}
    for path in corpus_files(corpus):
        stat = path.stat()
        out[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}
    return out


def corpus_changes(recorded: dict[str, dict], corpus: CorpusConfig) -> list[str]:
    """How the corpus files differ from `recorded`: hashes only the files whose size or mtime moved, and
    the files under new paths. A file found under another path with the recorded size and sha256 (the
    bundled corpus of a checkout or install elsewhere, a data folder moved) has not changed."""
    changes = []
    current = {str(p): p for p in corpus_files(corpus)}
    gone = {name: recorded[name] for name in sorted(set(recorded) - set(current))}
    for name in sorted(set(current) - set(recorded)):
        size = current[name].stat().st_size
        sized = [old for old, rec in gone.items() if rec["size"] == size]
        digest = file_sha256(current[name]) if sized else None  # hashed once, and only if a size matches
        same = next((old for old in sized if gone[old]["sha256"] == digest), None)
        if same is None:
            changes.append(f"corpus file {name}: new")
        else:
            log.info("corpus file %s is %s moved, the same content", name, same)
            del gone[same]
    changes[:0] = [f"corpus file {name}: gone" for name in gone]
    for name in sorted(set(current) & set(recorded)):
        old, stat = recorded[name], current[name].stat()
        if (stat.st_size, stat.st_mtime_ns) == (old["size"], old["mtime_ns"]):
            continue
        if stat.st_size != old["size"] or file_sha256(current[name]) != old["sha256"]:
            changes.append(f"corpus file {name}: content changed ({old['size']:,} → {stat.st_size:,} bytes)")
    return changes


def index_digest(run: RunDir) -> str:
    return file_sha256(run.shards / "index.json")


def record(run: RunDir, stage: str, config: Config, **inputs: Any) -> None:
    """Write `stage`'s record: its config values and input fingerprints (atomically)."""
    body = {"stage": stage, "keys": stage_values(config, stage), "inputs": inputs}
    write_text(record_path(run, stage), json.dumps(body, indent=1, sort_keys=True, default=str) + "\n")


def completed(run: RunDir, stage: str) -> bool:
    """Did `stage` (pretrain, route or shard) finish in `run`? Its record says so, written after every
    artifact: artifacts without one are an interrupted stage's, which `dipaco run` redoes. A run without
    any record that was sharded was made before records existed: its route and shard are done. The warm
    start (no record) is done when its Hugging Face copy, written last and renamed into place, is."""
    if stage == "pretrain":
        return (run.pretrain / "summary.json").exists() and (run.pretrain / "hf").is_dir()
    if record_path(run, stage).exists():
        return True
    return _before_records(run) and _done(run, stage)


def _before_records(run: RunDir) -> bool:
    """A run sharded by a dipaco that wrote no records (none of its stages has one)."""
    return (run.shards / "index.json").exists() and not any(record_path(run, s).exists() for s in STAGE_KEYS)


def _done(run: RunDir, stage: str) -> bool:
    return {"route": (run.routing / "assignments.json").exists(), "shard": (run.shards / "index.json").exists(),
            "train": record_path(run, "train").exists() or run.train_summary.exists()}[stage]


def _router_fingerprint(run: RunDir) -> str | None:
    try:
        return json.loads((run.routing / "router.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _shards_router_fingerprint(run: RunDir) -> str | None:
    try:
        return json.loads((run.shards / "index.json").read_text()).get("router_fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _fmt(value: Any) -> str:
    return json.dumps(value, default=str)


def differences(run: RunDir, config: Config, stage: str) -> list[str]:
    """What differs between `stage`'s artifacts in `run` and what `config` (and the inputs now) would make;
    [] when they agree or `stage` has not run."""
    if not _done(run, stage):
        return []
    diffs: list[str] = []
    if stage == "shard":  # the shards' own router fingerprint: checkable even without a record
        packed, current = _shards_router_fingerprint(run), _router_fingerprint(run)
        if packed and current and packed != current:
            diffs.append(f"router: shards/index.json was packed for router {packed[:12]}, routing/router.json "
                         f"is router {current[:12]} (routed again after sharding)")
    path = record_path(run, stage)
    if not path.exists():
        log.warning("%s: %s has no record: made before dipaco recorded fingerprints, or its stage was "
                    "interrupted; its config keys are not checked (`dipaco run` redoes it with a record)",
                    run.root, MADE_BY[stage])
        return diffs
    try:
        saved = json.loads(path.read_text())
        keys, inputs = saved["keys"], saved["inputs"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DriftError(f"{path} cannot be read ({err}); redo the stage with `dipaco run --restart-from {stage}` "
                         f"or use a new run directory") from None
    now = stage_values(config, stage)
    for key in sorted(set(keys) | set(now)):
        if keys.get(key, "<unset>") != now.get(key, "<unset>"):
            diffs.append(f"{key}: {_fmt(keys.get(key, '<unset>'))} → {_fmt(now.get(key, '<unset>'))}")
    if stage == "route" and "corpus" in inputs and keys.get("corpus.path") == now.get("corpus.path"):
        diffs += corpus_changes(inputs["corpus"], config.corpus)
    if stage == "train" and "shards" in inputs and (run.shards / "index.json").exists():
        if inputs["shards"] != index_digest(run):
            diffs.append("shards/index.json: the store was trained on other shards (sharded again after training)")
    return diffs


def check(run: RunDir, config: Config, stages: tuple[str, ...]) -> None:
    """Raise DriftError naming every difference of the upstream `stages` of `run`, and the ways out."""
    found = [(stage, diffs) for stage in stages if stage in STAGE_KEYS and (diffs := differences(run, config, stage))]
    if not found:
        return
    first = found[0][0]
    lines = [f"{run.root} holds artifacts made with other settings than this command's:"]
    for stage, diffs in found:
        lines.append(f"  {stage} ({MADE_BY[stage]}):")
        lines += [f"    {d}" for d in diffs]
    lines.append("Nothing was run and config.yaml is unchanged. To go on with this run, set these keys back "
                 "(without --config, every command uses the run's own config.yaml). To use the new values, use a "
                 f"new --run directory, or redo this run from the first stale stage: `dipaco run --run {run.root} "
                 f"--restart-from {first} ...` (the old artifacts are moved to {run.root / 'superseded'}/).")
    raise DriftError("\n".join(lines))


def accept_new_shards(run: RunDir) -> None:
    """`dipaco reroute` re-shards a trained run on purpose: the store goes on training on the new shards."""
    path = record_path(run, "train")
    if path.exists():
        body = json.loads(path.read_text())
        body.setdefault("inputs", {})["shards"] = index_digest(run)
        write_text(path, json.dumps(body, indent=1, sort_keys=True, default=str) + "\n")


# stage → what it writes in the run directory (moved aside by `--restart-from` that stage or an earlier one)
ARTIFACTS = {
    "pretrain": ("pretrain",),
    "route": ("routing", "tokenizer"),
    "shard": ("shards",),
    "train": ("store", "train.json", "train-fingerprint.json", "logs"),
    "baselines": ("baselines",),
    "eval": ("eval.json",),
    "report": (),  # written again every time
}


def restart_from(run: RunDir, config: Config, stage: str) -> Path | None:
    """Move the artifacts of `stage` and every later stage to `superseded/<UTC time>/` so that `dipaco run`
    redoes them; returns that folder (None when there was nothing to move). A remote module store
    (`store.url`) cannot be moved: refused."""
    import time

    later = STAGE_ORDER[STAGE_ORDER.index(stage):]
    if config.store.url and "train" in later:
        raise ValueError(f"--restart-from {stage} redoes training, but store.url {config.store.url!r} "
                         f"holds the old modules and dipaco does not delete a store it did not create there: "
                         f"point store.url at a new location (or empty it yourself)")
    names = [name for s in later for name in ARTIFACTS[s] if (run.root / name).exists()]
    if not names:
        return None
    dest = run.root / "superseded" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest.mkdir(parents=True, exist_ok=False)
    for name in names:
        (run.root / name).rename(dest / name)
    log.info("--restart-from %s: moved %s to %s", stage, ", ".join(names), dest)
    return dest
