"""From YAML and `section.key=value` overrides to typed config sections; renamed keys named.

    raw, source = read_raw("configs/demo.yaml", ["run.rounds=20"])
    config = build_config(Config, raw, source=source)

Values are coerced to each field's type (an int where a float is expected, `1e-3` written without a
dot, a single value where a list is expected); anything else is an error naming the key, the value
and the file. A key this version renamed or replaced (`RENAMED`) is an error that names its new key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from routing.fields import choices, field_hints

RENAMED = {  # old key -> what replaces it
    "train.rounds": "run.rounds",
    "train.stop_after_round": "run.stop_after_round",
    "train.seed": "run.seed",
    "train.tensorboard": "run.tensorboard",
    "train.islands": "hardware.islands",
    "train.threads_per_island": "hardware.threads_per_island",
    "train.device": "hardware.device",
    "train.precision": "hardware.precision",
    "eval.device": "hardware.device (one device for training, baselines and evaluation)",
    "eval.precision": "hardware.precision (one precision for training, baselines and evaluation)",
    "train.compile": "hardware.compile",
    "train.tf32": "hardware.tf32",
    "train.fused_adamw": "inner.fused",
    "train.keep_rounds": "store.keep_versions",
    "train.store_url": "store.url",
    "train.cache_dir": "store.cache_dir",
    "train.cache_max_bytes": "store.cache_max_bytes",
    "train.heartbeat_seconds": "resilience.heartbeat_seconds",
    "train.heartbeat_timeout": "resilience.heartbeat_timeout",
    "train.lease_timeout": "resilience.lease_timeout",
    "train.checkpoint_steps": "resilience.checkpoint_steps",
    "outer.max_grad_norm_ratio": "resilience.max_norm_ratio",
    "outer.max_rejections": "resilience.max_rejections",
    "train.fail_mtbf": "faults.mtbf",
    "train.return_after": "faults.return_after",
    "train.fail_mode": "faults.mode",
    "train.slowdown": "faults.slowdown",
    "train.launcher": "launcher.kind",
    "train.ray_address": "launcher.ray_address",
    "train.ray_island_cpus": "launcher.ray_island_cpus",
    "train.ray_island_gpus": "launcher.ray_island_gpus",
    "train.ray_coordinator_cpus": "launcher.ray_coordinator_cpus",
    "train.ray_island_restarts": "launcher.ray_island_restarts",
    "outer.compression": "compression.codec",
    "outer.zstd_level": "compression.zstd_level",
    "outer.mode": "rounds.mode",
    "outer.quorum": "rounds.quorum",
    "outer.grace_seconds": "rounds.grace_seconds",
    "outer.staleness_power": "rounds.staleness_power",
    "outer.max_staleness": "rounds.max_staleness",
    "pretrain.steps": "warm_start.fraction (the share of the run's path-model steps spent on the warm start, "
                      "e.g. 0.5; not a step count)",
    "pretrain.warm_start": "warm_start.init_modules",
    "pretrain.continue_optimizer": "warm_start.continue_optimizer",
    "routing.reroute_candidates": "reroute.candidates",
    "routing.reroute_c": "reroute.c",
    "routing.reroute_target": "reroute.target",
    "simulate.inner_steps": "inner.steps (the simulator runs the config's own inner steps)",
    "simulate.checkpoint_steps": "simulate.checkpoint_interval",
}


def read_raw(path: str | os.PathLike | None, overrides: list[str]) -> tuple[dict[str, Any], str]:
    """The YAML file's mapping (empty without a file) with the overrides applied, and where it came from."""
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
    for item in overrides:
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
    return raw, source


def build_config(cls: type, raw: dict[str, Any], *, source: str) -> Any:
    """The config dataclass `cls` (sections of sections) from `raw`, every value coerced and checked."""
    renamed = [f"{s}.{k}" for s, keys in raw.items() if isinstance(keys, dict) for k in keys if f"{s}.{k}" in RENAMED]
    if renamed:
        old = renamed[0]
        raise ValueError(f"{old} in {source} is now {RENAMED[old]}")
    return _build(cls, raw, source=source, prefix="")


def _build(cls: type, raw: dict[str, Any], *, source: str, prefix: str) -> Any:
    hints = field_hints(cls)
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
    """`value` as the type `hint` names (bounds and choices are the section's own check)."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    origin = typing.get_origin(hint)
    if origin is Literal:  # the choice itself is the section's check (`routing.fields`)
        kinds = {type(v) for v in choices(hint)}
        if type(value) in kinds:
            return value
        raise ValueError(f"{key} in {source} must be one of {list(choices(hint))}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None) and value is None:
                return None
            if option is not type(None):
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
    elif hint is float and isinstance(value, str):
        try:
            value = float(value)  # YAML reads 1e-3 (no dot) as a string
        except ValueError:
            pass
        else:
            return _coerce(value, hint, key=key, source=source)
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{key} in {source} must be a finite number, got {value}")
        return float(value)
    elif hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{key} in {source} must be {_type_name(hint)}, got {value!r}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
