"""From YAML and `section.key=value` overrides to typed config sections; renamed keys named.

    raw, source = read_raw("configs/demo.yaml", ["run.rounds=20"])
    config = build_config(Config, raw, source=source)

Values are coerced to each field's type (an int where a float is expected, `1e-3` written without a
dot, a single value where a list is expected); anything else is a `ConfigError` naming the key, the
value and where the key came from (`Source`: the YAML file or the command line). An unknown key names
the nearest known one (difflib); a key this version renamed or replaced (`RENAMED`) names its new key.
No torch here: the command line checks a config before any heavy import.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
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


class ConfigError(ValueError):
    """A config that cannot be built: a bad key or value, named with where it came from."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a config's keys came from: `file` (None: the built-in defaults), and the `section.key`s
    given on the command line (`overrides`, which win over the file)."""

    file: str | None = None
    overrides: tuple[str, ...] = ()  # the command line's `section.key=value` items, as given

    def __str__(self) -> str:
        return self.file or "<defaults>"

    def of(self, key: str) -> str:
        """Where `key` (or a key under it, for a section) came from, for an error message."""
        items = [item for item in self.overrides if item.partition("=")[0] in (key, *_parents(key))]
        return f"the command line ({items[-1]})" if items else str(self)

    def blame(self, message: str) -> str:
        """Where the keys a check's `message` names came from: the command line's first, else the file."""
        keys = [item.partition("=")[0] for item in self.overrides]
        given = [k for k in keys if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", message)]
        return self.of(given[0]) if given else str(self)


def _parents(key: str) -> tuple[str, ...]:
    return (key.partition(".")[0],) if "." in key else ()


def read_raw(path: str | os.PathLike | None, overrides: list[str]) -> tuple[dict[str, Any], Source]:
    """The YAML file's mapping (empty without a file) with the overrides applied, and where each key came from.
    A file with no settings at all (empty, or only comments) is an error: it is not the built-in defaults."""
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text())
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
        if raw is None:
            raise ConfigError(f"config file {path} holds no settings (it is empty, or only comments); give a YAML "
                              f"file such as configs/tiny.yaml, or leave out --config for the run's own config")
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        section, name, value = _split_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"section {section!r} in {path} must be a mapping")
        raw[section][name] = value
    return raw, Source(file=str(path) if path else None, overrides=tuple(overrides))


def _split_override(item: str) -> tuple[str, str, Any]:
    """`"outer.lr=0.5"` → `("outer", "lr", 0.5)`, the value read as YAML."""
    key, sep, value = item.partition("=")
    parts = key.split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"the command line's override {item!r} must look like section.key=value")
    try:
        return parts[0], parts[1], yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"the command line's override {item!r}: the value is not valid YAML "
                          f"({str(err).splitlines()[0]})") from None


def build_config(cls: type, raw: dict[str, Any], *, source: Source | str) -> Any:
    """The config dataclass `cls` (sections of sections) from `raw`, every value coerced and checked."""
    source = source if isinstance(source, Source) else Source(file=source)
    renamed = [f"{s}.{k}" for s, keys in raw.items() if isinstance(keys, dict) for k in keys if f"{s}.{k}" in RENAMED]
    if renamed:
        old = renamed[0]
        raise ConfigError(f"{old} in {source.of(old)} is now {RENAMED[old]}")
    for section, keys in raw.items():  # an unknown section or key, with the nearest known key
        for name in keys if isinstance(keys, dict) else [None]:
            key = f"{section}.{name}" if name is not None else section
            if key not in (known := known_keys(cls)) and (name is not None or section not in _sections(cls)):
                raise ConfigError(f"unknown key {key} in {source.of(key)}{did_you_mean(key, known)}")
    return _build(cls, raw, source=source, prefix="")


def _sections(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def known_keys(cls: type) -> list[str]:
    """Every `section.key` of the config dataclass `cls` (a top-level field that is no section: its name)."""
    hints, keys = field_hints(cls), []
    for section in _sections(cls):
        if dataclasses.is_dataclass(hints[section]):
            keys += [f"{section}.{f.name}" for f in dataclasses.fields(hints[section]) if f.init]
        else:
            keys.append(section)
    return keys


def did_you_mean(key: str, known: list[str]) -> str:
    """"; did you mean X?" with the known key nearest to `key`: the same name in another section, else the
    nearest name in its section, else the nearest `section.key` (difflib); else the section's keys."""
    section, _, name = key.partition(".")
    same_name = [k for k in known if k.partition(".")[2] == name and name]
    in_section = [k.partition(".")[2] for k in known if k.partition(".")[0] == section]
    near = same_name or [f"{section}.{m}" for m in difflib.get_close_matches(name, in_section, n=1, cutoff=0.6)]
    if not in_section:  # an unknown section (outr.fragments): the nearest section.key
        near = near or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if near:
        return f"; did you mean {near[0]}?"
    if in_section:
        return f"; the keys of {section}: {sorted(in_section)}"
    return f"; the sections are {sorted({k.partition('.')[0] for k in known})}"


def _build(cls: type, raw: dict[str, Any], *, source: Source, prefix: str) -> Any:
    hints = field_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} in {source.of(key)} must be a mapping, got {value!r}")
            kwargs[name] = _build(hint, value, source=source, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(value, hint, key=key, source=source.of(key))
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ConfigError(f"{err} (in {source.blame(str(err))})") from None


def _coerce(value: Any, hint: Any, *, key: str, source: str) -> Any:
    """`value` as the type `hint` names (bounds and choices are the section's own check)."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    origin = typing.get_origin(hint)
    if origin is Literal:  # the choice itself is the section's check (`routing.fields`)
        kinds = {type(v) for v in choices(hint)}
        if type(value) in kinds:
            return value
        raise ConfigError(f"{key} in {source} must be one of {list(choices(hint))}, got {value!r}")
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
            raise ConfigError(f"{key} in {source} must be a finite number, got {value}")
        return float(value)
    elif hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key} in {source} must be {_type_name(hint)}, got {value!r}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
