"""Debian packages as verified, extracted trees for the corpus builders: the version and SHA256 that apt's
(signed) package lists give for a package, its .deb found in a cache folder or fetched by
``apt-get download``, refused by name unless its SHA256 is the listed one, and unpacked with
``dpkg-deb -x`` (no root needed) into a folder that is reused while its marker names the same SHA256."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dipaco.store.publish import file_sha256

MARKER = ".dipaco-extracted"  # written last into an extracted tree: the .deb's SHA256


@dataclass(frozen=True, kw_only=True)
class AptRecord:
    """What apt's package lists say about one version of a package."""

    package: str  # Debian package name
    version: str  # the version, epoch included
    sha256: str  # SHA256 of the .deb, from the package list
    size: int  # size of the .deb in bytes
    filename: str  # the .deb's path in the archive pool (Filename field)

    def file_names(self) -> tuple[str, ...]:
        """Names the .deb may have locally: the pool's, and apt's (epoch ':' written '%3a')."""
        pool = Path(self.filename).name
        arch = pool.rsplit("_", 1)[-1]
        return tuple(dict.fromkeys((pool, f"{self.package}_{self.version.replace(':', '%3a')}_{arch}")))


def _apt(*args: str) -> str:
    done = subprocess.run(["apt-cache", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"apt-cache {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def parse_stanza(text: str) -> dict[str, str]:
    """The single-line fields of the first stanza of `apt-cache show` output."""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        if line[:1] not in (" ", "\t") and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def apt_record(package: str) -> AptRecord:
    """The candidate version of `package` and its listed SHA256 (SystemExit when apt knows none)."""
    candidate = ""
    for line in _apt("policy", package).splitlines():
        if line.strip().startswith("Candidate:"):
            candidate = line.split(":", 1)[1].strip()
    if not candidate or candidate == "(none)":
        raise SystemExit(f"apt knows no version of {package}; run apt-get update")
    fields = parse_stanza(_apt("show", f"{package}={candidate}"))
    missing = [k for k in ("Version", "SHA256", "Size", "Filename") if k not in fields]
    if missing:
        raise SystemExit(f"apt-cache show {package}={candidate} lacks {', '.join(missing)}")
    return AptRecord(package=package, version=fields["Version"], sha256=fields["SHA256"].lower(),
                     size=int(fields["Size"]), filename=fields["Filename"])


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in blocks (dipaco.store.publish's)."""
    return file_sha256(path)


def verify(path: Path, record: AptRecord) -> None:
    """Refuse (SystemExit naming the file) a .deb whose SHA256 is not the listed one."""
    actual = sha256_file(path)
    if actual != record.sha256:
        raise SystemExit(
            f"{path}: SHA256 {actual} is not the {record.sha256} that apt lists for "
            f"{record.package} {record.version}; refusing it (corrupt or another build: delete it and rerun)"
        )


def find_deb(record: AptRecord, folders: list[Path]) -> Path | None:
    """The first local copy of the record's .deb in `folders` (verified), or None."""
    for folder in folders:
        for name in record.file_names():
            if (folder / name).is_file():
                verify(folder / name, record)
                return folder / name
    return None


def fetch_deb(record: AptRecord, into: Path, cache_folders: list[Path]) -> Path:
    """The verified .deb of `record`: a cached copy, else one `apt-get download` puts in `into`."""
    found = find_deb(record, [*cache_folders, into])
    if found is not None:
        return found
    into.mkdir(parents=True, exist_ok=True)
    cmd = ["apt-get", "download", f"{record.package}={record.version}"]
    done = subprocess.run(cmd, cwd=into, capture_output=True, text=True, check=False)
    found = find_deb(record, [into])
    if done.returncode or found is None:
        raise SystemExit(f"{' '.join(cmd)} (in {into}) failed: {done.stderr.strip()[-500:]}")
    return found


def extract(deb: Path, sha256: str, dest: Path) -> Path:
    """`dpkg-deb -x deb dest` unless dest already holds this .deb (its marker names `sha256`)."""
    marker = dest / MARKER
    if marker.is_file() and marker.read_text().strip() == sha256:
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    partial.mkdir(parents=True)
    done = subprocess.run(["dpkg-deb", "-x", str(deb), str(partial)], capture_output=True, text=True, check=False)
    if done.returncode:
        shutil.rmtree(partial, ignore_errors=True)
        raise SystemExit(f"{deb}: dpkg-deb -x failed: {done.stderr.strip()[-500:]}")
    (partial / MARKER).write_text(sha256 + "\n")
    partial.rename(dest)
    return dest
