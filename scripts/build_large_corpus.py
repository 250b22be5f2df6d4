"""Build the large corpus, data/large/large_corpus.jsonl.zst (about 33x the bundled one in characters),
from Debian packages: the Linux 6.1 kernel source, the Python 3.11 and Perl 5.36 documentation and the
man pages (scripts/large_corpus_sources.py says what is read from each).

Every package is the version apt's package lists name as candidate; its .deb is taken from
/var/cache/apt/archives or fetched by ``apt-get download`` into data/large/debs, and refused by name
unless its SHA256 is the one apt lists. Files are cut into documents of at most 3,000 characters
(never spanning two files), documents under 200 characters or mostly hexadecimal numbers (data tables)
are dropped, exact duplicates are removed (the first in package, file and position order kept), and the
rest shuffled with ``--seed`` and written as the bundled corpus is: zstd JSON lines
``{"text": ..., "source": ...}``. Next to it: ``large_corpus.manifest.json`` (packages, versions,
SHA256s, licences, counts, the sha256 of the JSON lines), ``CORPUS.md`` and ``LICENSES/``.

Resumable and idempotent: verified .debs and extracted trees are reused, and a corpus whose manifest
names the same packages, seed and builder and whose file still has the manifest's SHA256 is not rebuilt.

    python scripts/build_large_corpus.py        # or: make corpus-large (downloads about 160 MB once)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_corpus import MIN_CHARS, write_atomic  # noqa: E402
from debian_debs import AptRecord, apt_record, extract, fetch_deb, sha256_file  # noqa: E402
from large_corpus_sources import SOURCES, LargeSource  # noqa: E402

log = logging.getLogger("build_large_corpus")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "data" / "large" / "large_corpus.jsonl.zst"
APT_CACHE = Path("/var/cache/apt/archives")
BUILDER = 1  # raise when the documents this script makes change
ZSTD_LEVEL = 10  # level 19 takes ~10 min a core on this size, for ~10% fewer bytes
HEX_SHARE = 0.3  # a document whose non-space characters are more than this share hex literals is a table
_HEX = re.compile(r"0[xX][0-9a-fA-F]+")


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name.split(".")[0] + ".manifest.json")


def is_table(text: str) -> bool:
    """Mostly hexadecimal literals (register values, firmware bytes): not text."""
    hex_chars = sum(len(m) for m in _HEX.findall(text))
    return hex_chars > HEX_SHARE * max(1, len(text) - text.count(" ") - text.count("\n"))


def collect(sources: Iterable[LargeSource], roots: dict[str, Path]) -> tuple[list[tuple[str, str]], Counter]:
    """(label, text) of every kept document, deduplicated, in source, file path and position order;
    and the counts of what was dropped and kept."""
    counts: Counter = Counter()
    seen: set[bytes] = set()
    kept: list[tuple[str, str]] = []
    for source in sources:
        files = sorted(source.files(roots), key=lambda f: f.path)
        counts[f"files {source.name}"] = len(files)
        for label, _path, docs in files:
            for doc in docs:
                if len(doc.strip()) < MIN_CHARS:
                    counts["dropped short"] += 1
                elif is_table(doc):
                    counts["dropped table"] += 1
                elif (key := hashlib.blake2b(doc.encode(), digest_size=16).digest()) in seen:
                    counts["dropped duplicate"] += 1
                else:
                    seen.add(key)
                    kept.append((label, doc))
        log.info("%-12s %7d files, %8d documents kept so far", source.name, len(files), len(kept))
    return kept, counts


def write_corpus(docs: list[tuple[str, str]], out: Path, level: int) -> dict:
    """Stream the JSON lines through zstd into out (atomically); their size and sha256, and the file's."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    digest, size = hashlib.sha256(), 0
    with open(tmp, "wb") as f, zstandard.ZstdCompressor(level=level).stream_writer(f, closefd=False) as w:
        for label, text in docs:
            line = (json.dumps({"text": text, "source": label}, ensure_ascii=False) + "\n").encode("utf-8")
            digest.update(line)
            size += len(line)
            w.write(line)
    os.replace(tmp, out)
    return {"jsonl_bytes": size, "jsonl_sha256": digest.hexdigest(),
            "compressed_bytes": out.stat().st_size, "compressed_sha256": sha256_file(out)}


def recipe(records: dict[str, AptRecord], seed: int) -> dict:
    """What the corpus is a function of: the builder, the seed and each package's .deb."""
    return {"builder": BUILDER, "seed": seed, "zstd_level": ZSTD_LEVEL,
            "packages": {p: f"{r.version} sha256:{r.sha256}" for p, r in sorted(records.items())}}


def up_to_date(out: Path, wanted: dict) -> bool:
    """The corpus exists, its manifest has this recipe, and the file has the manifest's SHA256."""
    manifest = manifest_path(out)
    if not (out.is_file() and manifest.is_file()):
        return False
    recorded = json.loads(manifest.read_text())
    return recorded.get("recipe") == wanted and sha256_file(out) == recorded.get("compressed_sha256")


def source_rows(docs: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    rows: dict[str, dict[str, int]] = {}
    for label, text in docs:
        row = rows.setdefault(label, {"documents": 0, "characters": 0})
        row["documents"] += 1
        row["characters"] += len(text)
    return dict(sorted(rows.items()))


def manifest(*, out: Path, records: dict[str, AptRecord], debs: dict[str, Path], seed: int,
             sources: Iterable[LargeSource], docs: list[tuple[str, str]], counts: Counter, written: dict,
             seconds: float) -> dict:
    """Everything needed to check and reproduce the corpus."""
    return {
        "corpus": out.name, "format": "zstd JSON lines {\"text\": str, \"source\": str}, one document a line",
        "recipe": recipe(records, seed), "documents": len(docs), "characters": sum(len(t) for _, t in docs),
        **written, "build_seconds": round(seconds, 1), "counts": dict(sorted(counts.items())),
        "sources": source_rows(docs),
        "packages": [{"package": p, "version": records[p].version, "sha256": records[p].sha256,
                      "size": records[p].size, "pool_file": records[p].filename, "read_from": str(debs[p]),
                      "source": s.name, "licence": s.licence, "licence_file": f"LICENSES/{p}.txt"}
                     for s in sources for p in s.packages],
    }


def write_licences(out_dir: Path, sources: Iterable[LargeSource], roots: dict[str, Path],
                   records: dict[str, AptRecord]) -> None:
    """LICENSES/<package>.txt: a provenance header, then the package's Debian copyright file verbatim
    (a package that links its doc folder to another's, as manpages-dev does, points at that one)."""
    for source in sources:
        found = {p: roots[p] / "usr" / "share" / "doc" / p / "copyright" for p in source.packages}
        found = {p: f for p, f in found.items() if f.is_file() and not f.is_symlink()}
        if not found:
            raise SystemExit(f"no Debian copyright file in {', '.join(source.packages)} ({source.name})")
        for p in source.packages:
            owner = p if p in found else next(iter(found))  # manpages-dev's doc folder links to manpages'
            header = (f"Corpus source: {source.name}\nDebian package: {p} {records[p].version}\n"
                      f"Licence in short: {source.licence}\n"
                      f"Copyright file: /usr/share/doc/{owner}/copyright of {owner}\n" + "=" * 72 + "\n\n")
            write_atomic(out_dir / "LICENSES" / f"{p}.txt", (header + found[owner].read_text()).encode())


def corpus_md(m: dict, sources: Iterable[LargeSource]) -> str:
    """CORPUS.md: what the corpus holds, from its manifest."""
    rows = "\n".join(f"| `{label}` | {r['documents']:,} | {r['characters']:,} |" for label, r in m["sources"].items())
    packages = "\n".join(f"| {p['package']} | {p['version']} | `{p['sha256']}` | {p['licence']} | "
                         f"[{p['licence_file']}]({p['licence_file']}) |" for p in m["packages"])
    described = "\n".join(f"- **{s.name}**: {s.description}." for s in sources)
    dropped = ", ".join(f"{v:,} {k.removeprefix('dropped ')}" for k, v in m["counts"].items() if k.startswith("dropped"))
    return f"""# The large corpus

`{m['corpus']}`: {m['documents']:,} documents, {m['characters']:,} characters, built by
`scripts/build_large_corpus.py` (`make corpus-large`) in {m['build_seconds']:,} s. Same format as the bundled
corpus: {m['format']}, shuffled (seed {m['recipe']['seed']}), zstd level {m['recipe']['zstd_level']}.

- compressed: {m['compressed_bytes']:,} bytes, sha256 `{m['compressed_sha256']}`
- uncompressed JSON lines: {m['jsonl_bytes']:,} bytes, sha256 `{m['jsonl_sha256']}`
- documents dropped: {dropped}

| source | documents | characters |
|---|---:|---:|
{rows}

{described}

Documents are at most 3,000 characters, never span two files, and start at a heading or a top-level
paragraph where they can; the text is as the package ships it (HTML reduced to text, man pages rendered).

| Debian package | version | .deb sha256 (as apt lists it) | licence | licence file |
|---|---|---|---|---|
{packages}
"""


def prepare(sources: Iterable[LargeSource], records: dict[str, AptRecord], work: Path,
            cache_folders: list[Path]) -> tuple[dict[str, Path], dict[str, Path]]:
    """Each package's verified .deb and its extracted tree (both reused when already there)."""
    debs, roots = {}, {}
    for source in sources:
        for p in source.packages:
            record = records[p]
            debs[p] = fetch_deb(record, work / "debs", cache_folders)
            folder = f"{p}_{record.version.replace(':', '%3a')}"
            roots[p] = extract(debs[p], record.sha256, work / "extracted" / folder)
            log.info("%-18s %s: %s", p, record.version, debs[p])
    return debs, roots


def build(*, out: Path, records: dict[str, AptRecord], sources: tuple[LargeSource, ...] = SOURCES,
          seed: int = 0, cache_folders: tuple[Path, ...] = (APT_CACHE,), force: bool = False) -> dict:
    """Build (or find up to date) the corpus at `out`; its manifest."""
    wanted = recipe({p: records[p] for s in sources for p in s.packages}, seed)
    if not force and up_to_date(out, wanted):
        log.info("%s is up to date (manifest recipe and sha256 match); --force rebuilds it", out)
        return json.loads(manifest_path(out).read_text())
    started = time.perf_counter()
    debs, roots = prepare(sources, records, out.parent, list(cache_folders))
    docs, counts = collect(sources, roots)
    random.Random(seed).shuffle(docs)
    written = write_corpus(docs, out, ZSTD_LEVEL)
    m = manifest(out=out, records=records, debs=debs, seed=seed, sources=sources, docs=docs, counts=counts,
                 written=written, seconds=time.perf_counter() - started)
    m["recipe"] = wanted
    write_licences(out.parent, sources, roots, records)
    write_atomic(out.parent / "CORPUS.md", corpus_md(m, sources).encode())
    write_atomic(manifest_path(out), (json.dumps(m, indent=1) + "\n").encode())  # last: the build is complete
    return m


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the .jsonl.zst file to write")
    parser.add_argument("--seed", type=int, default=0, help="shuffling seed")
    parser.add_argument("--force", action="store_true", help="rebuild even when the corpus is up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if shutil.which("groff") is None:
        log.warning("groff is not installed: the man pages are left out (apt-get install groff-base)")
    records = {p: apt_record(p) for s in SOURCES for p in s.packages}
    m = build(out=args.out, records=records, seed=args.seed, force=args.force)
    log.info("%s: %d documents, %d characters, %d bytes compressed (%d as JSON lines), built in %.0f s",
             args.out, m["documents"], m["characters"], m["compressed_bytes"], m["jsonl_bytes"], m["build_seconds"])


if __name__ == "__main__":
    main()
