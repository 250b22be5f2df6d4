"""The manifest of an exported mixture, `dipaco_mixture.json`: what the directory holds and how to route.

    manifest = read_manifest(Path("out/demo"))      # ValueError naming the file and the field when wrong
    manifest.paths[3].dir, manifest.prefix_tokens, manifest.router, manifest.featurizer

A mixture directory (written by `dipaco export DIR`, `dipaco.stages.export`; a Hugging Face repository,
`dipaco.inference.hub_repo`):

    dipaco_mixture.json   this manifest (format_version 2)
    config.json, configuration_dipaco.py, modeling_dipaco.py     the mixture for transformers (trust_remote_code)
    model-0000i-of-0000n.safetensors + model.safetensors.index.json   every module once (`grid.<module>.<param>`)
    tokenizer.json, tokenizer_config.json, ...   the run's tokenizer (`tokenizer`: "."; no pickle)
    README.md             the model card
    router/               router.json + router.safetensors (`routing.router.Router`)
    featurizer/           the model the router featurizes prefixes with, when it uses one (`base-model`, `hf`)
    path-0003/            with `--per-path` only: a Hugging Face model directory per routed path

A path entry names its modules ({module: the name its tensors are stored under}) and, with
`--per-path`, its directory (`dir`). Format 1 (a directory per path, the tokenizer in `tokenizer/`) is read too.

Every name in the manifest is a directory relative to it, so the directory can be copied, moved or
uploaded whole. Paths are numbered as the run numbers them (with DiLoCo replicas, the routed path's
first replica, the one evaluation loads).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = "dipaco_mixture.json"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
FORMAT = "dipaco-mixture"
PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".pkl", ".ckpt")  # never written into, nor read from, a mixture


def pickled_files(directory: Path) -> list[str]:
    """The files of `directory` whose loading would unpickle (a mixture holds safetensors and JSON only)."""
    return sorted(f.name for f in directory.iterdir() if f.is_file() and f.suffix in PICKLED_WEIGHTS)


@dataclass(frozen=True)
class PathEntry:
    """One exported path: the module choice per level, the module version it holds, its modules ({module:
    stored name} in the shards; None in format 1) and its own directory (None unless `--per-path`)."""

    dir: str | None
    choice: list[int]
    round: int
    modules: dict[str, str] | None = None


@dataclass(frozen=True)
class Manifest:
    """What `dipaco_mixture.json` says (`paths`: {path id: entry}; `router`/`featurizer`: directories or None)."""

    levels: list[int]
    replicas: int
    prefix_tokens: int
    max_length: int
    tokenizer: str
    router: str | None
    featurizer: str | None
    route: str
    paths: dict[int, PathEntry]
    format_version: int = FORMAT_VERSION
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["paths"] = {str(p): asdict(e) for p, e in sorted(self.paths.items())}
        return {"format": self.format, "format_version": self.format_version,
                **{k: v for k, v in data.items() if k not in ("format", "format_version")}}


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write `directory/dipaco_mixture.json`; returns its path."""
    file = directory / MANIFEST
    file.write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    return file


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of the mixture in `directory`, every field checked (a ValueError names the file and
    the field); the directories it names must exist inside `directory`."""
    file = Path(directory) / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: {directory} is not a mixture exported by `dipaco export`")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    field = _Fields(file, data)
    if field.get("format", str) != FORMAT:
        raise ValueError(f"{file}: field 'format' is {data['format']!r}, not {FORMAT!r}")
    version = field.get("format_version", int)
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{file}: field 'format_version' is {version}; this dipaco reads {list(READABLE_VERSIONS)}")
    levels = field.get("levels", list)
    if not levels or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in levels):
        raise ValueError(f"{file}: field 'levels' must be a non-empty list of integers >= 1, got {levels!r}")
    manifest = Manifest(
        levels=levels, replicas=field.positive("replicas"), prefix_tokens=field.positive("prefix_tokens"),
        max_length=field.positive("max_length"), tokenizer=field.directory("tokenizer"),
        router=field.directory("router", optional=True), featurizer=field.directory("featurizer", optional=True),
        route=field.get("route", str), paths=_paths(field, version), format_version=version)
    if manifest.route not in ("router", "likelihood"):
        raise ValueError(f"{file}: field 'route' must be 'router' or 'likelihood', got {manifest.route!r}")
    expected = {q * manifest.replicas for q in range(math.prod(levels))}
    if set(manifest.paths) != expected:
        raise ValueError(f"{file}: field 'paths' holds paths {sorted(manifest.paths)}, but levels {levels} with "
                         f"{manifest.replicas} replica(s) route to paths {sorted(expected)}")
    if manifest.route == "router" and manifest.router is None:
        raise ValueError(f"{file}: field 'route' is 'router' but field 'router' is null")
    return manifest


class _Fields:
    """Typed reads of the manifest's fields, each error naming the file and the field."""

    def __init__(self, file: Path, data: dict[str, Any]):
        self.file, self.data = file, data

    def get(self, name: str, kind: type, data: dict[str, Any] | None = None, where: str = "") -> Any:
        data = self.data if data is None else data
        if name not in data:
            raise ValueError(f"{self.file}: field {where + name!r} is missing")
        value = data[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{self.file}: field {where + name!r} must be {kind.__name__}, got {value!r}")
        return value

    def positive(self, name: str, data: dict[str, Any] | None = None, where: str = "", minimum: int = 1) -> int:
        value = self.get(name, int, data, where)
        if value < minimum:
            raise ValueError(f"{self.file}: field {where + name!r} must be >= {minimum}, got {value}")
        return value

    def directory(self, name: str, data: dict[str, Any] | None = None, where: str = "",
                  optional: bool = False) -> str | None:
        """A directory named relative to the manifest, inside it, that exists."""
        data = self.data if data is None else data
        if optional and data.get(name, None) is None:
            if name not in data:
                raise ValueError(f"{self.file}: field {where + name!r} is missing (null when there is none)")
            return None
        value = self.get(name, str, data, where)
        relative = PurePosixPath(value)
        if relative.is_absolute() or ".." in relative.parts or (not relative.parts and value != "."):
            raise ValueError(f"{self.file}: field {where + name!r} must name a directory inside the mixture, "
                             f"got {value!r}")
        if not (self.file.parent / relative).is_dir():
            raise ValueError(f"{self.file}: field {where + name!r} names {value!r}, which is not a directory "
                             f"in {self.file.parent}")
        return value


def _paths(field: _Fields, version: int) -> dict[int, PathEntry]:
    raw = field.get("paths", dict)
    if not raw:
        raise ValueError(f"{field.file}: field 'paths' is empty")
    paths = {}
    for key, entry in raw.items():
        where = f"paths.{key}."
        if not key.isdigit():
            raise ValueError(f"{field.file}: field 'paths' has key {key!r}, not a path number")
        if not isinstance(entry, dict):
            raise ValueError(f"{field.file}: field {where[:-1]!r} must be an object, got {entry!r}")
        directory = field.directory("dir", entry, where, optional=version >= 2)
        if directory is not None and not (field.file.parent / directory / "config.json").is_file():
            raise ValueError(f"{field.file}: field {where + 'dir'!r} names {directory!r}, which has no config.json")
        modules = _modules(field, entry, where) if version >= 2 else None
        choice = field.get("choice", list, entry, where)
        if len(choice) != len(field.data["levels"]) or not all(isinstance(c, int) for c in choice):
            raise ValueError(f"{field.file}: field {where + 'choice'!r} must hold one module per level "
                             f"({len(field.data['levels'])}), got {choice!r}")
        paths[int(key)] = PathEntry(dir=directory, choice=choice, round=field.positive("round", entry, where, minimum=0),
                                    modules=modules)
    return paths


def _modules(field: _Fields, entry: dict[str, Any], where: str) -> dict[str, str]:
    """A path's {module: stored name}: names only (they are looked up in the shards' index when loaded)."""
    modules = field.get("modules", dict, entry, where)
    if not modules or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in modules.items()):
        raise ValueError(f"{field.file}: field {where + 'modules'!r} must map each module to the name it is "
                         f"stored under, got {modules!r}")
    return modules
