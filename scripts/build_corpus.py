"""Build the bundled demo corpus, dipaco/data/demo_corpus.jsonl.zst, from public-domain and
freely licensed text that Debian ships:

- ``bible-kjv``   the King James Bible (public domain), dumped by the ``bible`` program;
- ``python-docs`` the Python 3.11 documentation's reST sources (PSF licence, python3.11-doc);
- ``perl-docs``   the Perl 5.36 core documentation in POD (GPL-1+ or Artistic, perl-doc).

Each source is split on natural boundaries (Bible chapters, reST section headings, POD ``=head``
sections), paragraphs are grouped up to ``MAX_CHARS`` characters, and documents shorter than
``MIN_CHARS`` are dropped. Documents are shuffled with ``--seed`` so the sources interleave and
written as zstd-compressed JSON lines ``{"text": ..., "source": ...}``, which
``datasets.load_dataset("json", data_files=...)`` reads directly. Next to the corpus the script
writes ``LICENSES/<source>.txt`` (the Debian copyright files) and ``CORPUS.md`` (what is in it).

Run (CPU, about 20 s):

    apt-get install bible-kjv python3.11-doc perl-doc   # once
    python scripts/build_corpus.py                       # or: make corpus
    python scripts/build_corpus.py --out /tmp/corpus.jsonl.zst --seed 1
"""

import argparse
import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import zstandard
from corpus_text import Unit, normalise, pack, paragraphs

log = logging.getLogger("build_corpus")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "dipaco" / "data" / "demo_corpus.jsonl.zst"
MIN_CHARS = 200  # shorter documents are dropped
TARGET_CHARS = 500  # a heading starts a new document once the current one has this many characters
MAX_CHARS = 3000  # no document is longer
MAX_BYTES = 10_000_000  # the compressed corpus must fit in this
ZSTD_LEVEL = 19

BIBLE_RANGE = "Gen1:1-Rev22:21"
PYTHON_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
PERL_POD = Path("/usr/share/perl/5.36/pod")
# Generated files, not prose: perltoc is a table of contents of all the other pages (it repeats
# their headings) and perluniprops a table of Unicode properties.
PERL_SKIP = frozenset({"perltoc.pod", "perluniprops.pod"})

_ADORNMENT = re.compile(r"""^([!-/:-@\[-`{-~])\1{2,}$""")  # a reST title under/overline
_RST_LABEL = re.compile(r"^(\.\. _[^\n]+:\n?)+$")  # ".. _label:" lines, which precede a title
_POD_HEADING = re.compile(r"^=head[1-4]\b")


@dataclass(frozen=True, kw_only=True)
class Source:
    """One corpus source: where its text comes from and how it is cut into units."""

    name: str  # the value of the "source" field
    package: str  # the Debian package that provides it
    required: tuple[Path, ...]  # files whose absence means the package is missing
    copyright: Path  # the package's Debian copyright file, copied to LICENSES/
    description: str  # one line for CORPUS.md
    licence: str  # short licence name for CORPUS.md
    split: str  # how documents were split, for CORPUS.md
    sep: str  # joins the units of one document
    max_chars: int = MAX_CHARS  # longest document of this source
    streams: Callable[[], Iterator[list[Unit]]]  # one unit list per file; documents never span two


def documents(source: Source) -> list[str]:
    """All documents of a source, in file order, each MIN_CHARS..source.max_chars characters long."""
    docs = []
    for units in source.streams():
        for doc in pack(units, sep=source.sep, target=TARGET_CHARS, max_chars=source.max_chars):
            doc = doc.strip("\n")
            if len(doc.strip()) >= MIN_CHARS:
                docs.append(doc)
    return docs


# ---------------------------------------------------------------- the sources


def bible_streams() -> Iterator[list[Unit]]:
    """The whole Bible as one stream: chapter titles ("Psalms 117") are headings, verses units."""
    cmd = ["bible", "-l100000", BIBLE_RANGE]  # a wide line limit: one verse per line
    text = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True).stdout
    units = []
    for line in normalise(text).splitlines():
        if line.startswith(" "):
            units.append(Unit(line))
        elif line:
            units.append(Unit(f"\n{line}\n", heading=True))  # with sep "\n": a blank line around it
    yield units


def is_rst_heading(para: str) -> bool:
    """A reST section title (title + underline, or overline + title + underline) or the labels
    that precede one, so a label starts the document of its section."""
    if _RST_LABEL.match(para):
        return True
    lines = para.split("\n")
    if len(lines) >= 3 and _ADORNMENT.match(lines[0]) and _ADORNMENT.match(lines[2]):
        return True
    return len(lines) >= 2 and not lines[0][:1].isspace() and bool(_ADORNMENT.match(lines[1]))


def python_streams() -> Iterator[list[Unit]]:
    """One stream per .rst.txt file; section titles are headings."""
    for path in sorted(PYTHON_SOURCES.rglob("*.rst.txt")):
        paras = paragraphs(normalise(path.read_text(encoding="utf-8")))
        yield [Unit(p, heading=is_rst_heading(p)) for p in paras]


def perl_streams() -> Iterator[list[Unit]]:
    """One stream per .pod file; =head1..=head4 paragraphs are headings."""
    for path in sorted(PERL_POD.glob("*.pod")):
        if path.name in PERL_SKIP:
            continue
        paras = paragraphs(normalise(path.read_text(encoding="utf-8")))
        yield [Unit(p, heading=bool(_POD_HEADING.match(p))) for p in paras]


SOURCES = (
    Source(
        name="bible-kjv",
        package="bible-kjv",
        required=(Path("/usr/lib/bible.data"),),
        copyright=Path("/usr/share/doc/bible-kjv/copyright"),
        description="The King James Version of the Bible (1611), all 66 books, as printed by "
        f"`bible -l100000 {BIBLE_RANGE}`",
        licence="public domain (the KJV text); the `bible` program is GPL-2+",
        split="by chapter (title line, then one numbered verse per line); short chapters are joined "
        "to the next, long ones cut between verses",
        sep="\n",
        max_chars=1500,  # groups of verses: balances the document count against the larger sources
        streams=bible_streams,
    ),
    Source(
        name="python-docs",
        package="python3.11-doc",
        required=(PYTHON_SOURCES / "contents.rst.txt",),
        copyright=Path("/usr/share/doc/python3.11-doc/copyright"),
        description=f"Python 3.11 documentation, reST sources `{PYTHON_SOURCES}/**/*.rst.txt`",
        licence="PSF License Agreement (Python Software Foundation License)",
        split="per file, at section titles; blank-line paragraphs grouped (indented blocks kept with "
        "the paragraph before), long ones cut between paragraphs or lines",
        sep="\n\n",
        streams=python_streams,
    ),
    Source(
        name="perl-docs",
        package="perl-doc",
        required=(PERL_POD / "perlfunc.pod",),
        copyright=Path("/usr/share/doc/perl-doc/copyright"),
        description=f"Perl 5.36 core documentation in POD, `{PERL_POD}/*.pod` without "
        f"{', '.join(sorted(PERL_SKIP))} (generated tables)",
        licence="GPL-1+ or the Artistic License (Perl's licence)",
        split="per file, at `=head1`..`=head4`; blank-line paragraphs grouped (verbatim blocks kept "
        "with the paragraph before), long ones cut between paragraphs or lines",
        sep="\n\n",
        streams=perl_streams,
    ),
)


def check_installed(source: Source) -> None:
    """Fail with the apt-get line when a source's Debian package is missing."""
    missing = [p for p in (*source.required, source.copyright) if not p.exists()]
    if source.name == "bible-kjv" and shutil.which("bible") is None:
        missing.append(Path("bible (program on PATH)"))
    if missing:
        raise SystemExit(
            f"source {source.name!r} is missing {', '.join(map(str, missing))}; "
            f"install it with: apt-get install {source.package}"
        )


# ---------------------------------------------------------------- fitting, writing, describing


def serialise(docs: list[tuple[str, str]]) -> bytes:
    """(source, text) pairs as JSON lines."""
    lines = (json.dumps({"text": text, "source": src}, ensure_ascii=False) for src, text in docs)
    return ("\n".join(lines) + "\n").encode("utf-8")


def compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).compress(data)


def cap_per_source(by_source: dict[str, list[str]], budget_chars: int) -> dict[str, list[str]]:
    """Keep the first `cap` documents of every source, the largest cap within budget_chars, so a
    small source is kept whole and the large ones are trimmed to the same count."""

    def chars(cap: int) -> int:
        return sum(len(d) for docs in by_source.values() for d in docs[:cap])

    lo, hi = 0, max(len(docs) for docs in by_source.values())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if chars(mid) <= budget_chars else (lo, mid - 1)
    return {name: docs[:lo] for name, docs in by_source.items()}


def build(
    by_source: dict[str, list[str]], *, seed: int, max_bytes: int
) -> tuple[dict[str, list[str]], bytes, bytes]:
    """Shuffle, serialise and compress; subsample per source while the result exceeds max_bytes.
    Returns (kept documents per source, jsonl bytes, compressed bytes)."""
    rng = random.Random(seed)
    for docs in by_source.values():
        rng.shuffle(docs)  # subsampling keeps a prefix: a uniform sample of the source
    kept = by_source
    for _ in range(8):
        mixed = [(name, d) for name, docs in kept.items() for d in docs]
        random.Random(seed).shuffle(mixed)
        raw = serialise(mixed)
        packed = compress(raw)
        if len(packed) <= max_bytes:
            return kept, raw, packed
        total = sum(len(d) for docs in kept.values() for d in docs)
        budget = int(total * 0.97 * max_bytes / len(packed))
        log.info(
            "compressed %d bytes > %d: subsampling to about %d characters", len(packed), max_bytes, budget
        )
        kept = cap_per_source(kept, budget)
    raise SystemExit(f"could not fit the corpus into {max_bytes} bytes")


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, then rename over path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def package_version(package: str) -> str:
    cmd = ["dpkg-query", "-W", "-f=${Version}", package]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def write_licences(out_dir: Path, versions: dict[str, str]) -> None:
    """LICENSES/<source>.txt: a provenance header, then the Debian copyright file verbatim."""
    for s in SOURCES:
        header = (
            f"Corpus source: {s.name}\n"
            f"Copied from: {s.copyright} (Debian package {s.package} {versions[s.name]})\n"
            f"Licence in short: {s.licence}\n" + "=" * 72 + "\n\n"
        )
        write_atomic(out_dir / "LICENSES" / f"{s.name}.txt", (header + s.copyright.read_text()).encode())


def corpus_md(
    kept: dict[str, list[str]],
    *,
    out: Path,
    raw: bytes,
    packed: bytes,
    seed: int,
    subsampled: bool,
    max_bytes: int,
    versions: dict[str, str],
) -> str:
    """CORPUS.md: sources, licences, splitting, counts, rebuild command."""
    rows = []
    for s in SOURCES:
        docs = kept[s.name]
        chars = sum(map(len, docs))
        rows.append(
            f"| `{s.name}` | {s.package} {versions[s.name]} | {len(docs):,} | {chars:,} | "
            f"{min(map(len, docs), default=0):,}–{max(map(len, docs), default=0):,} | {s.licence} | [LICENSES/{s.name}.txt](LICENSES/{s.name}.txt) |"
        )
    n_docs = sum(map(len, kept.values()))
    n_chars = sum(len(d) for docs in kept.values() for d in docs)
    fit = (
        f"The compressed file had to fit in {max_bytes:,} bytes, so every source was cut to at most the same number "
        "of documents (a seeded, uniform sample)."
        if subsampled
        else f"Everything fits in {max_bytes:,} bytes compressed, so nothing was subsampled (a larger "
        "build would cut every source to the same document count, a seeded uniform sample)."
    )
    limits = ", ".join(f"{s.max_chars} characters for `{s.name}`" for s in SOURCES)
    sources = "\n".join(f"- **`{s.name}`**: {s.description}. Split {s.split}." for s in SOURCES)
    return f"""# The bundled demo corpus

`{out.name}` is a small real-text corpus that ships with dipaco so the whole pipeline runs offline.
It holds {n_docs:,} documents ({n_chars:,} characters) from three clearly different sources, the
kind of mixture that routing should separate. It is generated by `scripts/build_corpus.py`.

## Format

One JSON object per line, `{{"text": ..., "source": ...}}`, shuffled (seed {seed}) so the sources are
interleaved, zstd-compressed (level {ZSTD_LEVEL}). It loads like any user corpus:

```python
import datasets
from dipaco.data import demo_corpus_path
ds = datasets.load_dataset("json", data_files=str(demo_corpus_path()), split="train")
```

- compressed: {len(packed):,} bytes; uncompressed JSON lines: {len(raw):,} bytes
- sha256 of the uncompressed JSON lines: `{hashlib.sha256(raw).hexdigest()}`

## Sources

| source | Debian package | documents | characters | chars/doc (min–max) | licence | licence file |
|---|---|---:|---:|---:|---|---|
{chr(10).join(rows)}

{sources}

## How documents were made

- Whitespace is normalised lightly: Unix newlines, trailing spaces stripped, runs of three or more
  blank lines collapsed to two, and in the reST and POD sources one blank line between the
  paragraphs a document is made of. The text is otherwise as the package ships it (reST and POD
  markup included).
- A heading starts a new document once the current one holds {TARGET_CHARS} characters; smaller
  sections are joined to the next. No document is longer than its source's limit ({limits}):
  longer sections are cut between paragraphs (verses for the Bible), then lines. Documents under {MIN_CHARS} characters are
  dropped. Documents never span two files.
- {fit}

## Rebuild

```
apt-get install bible-kjv python3.11-doc perl-doc
make corpus        # = python scripts/build_corpus.py [--out PATH] [--seed N]
```

The same packages and seed give the same JSON lines (check the sha256 above).
"""


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the .jsonl.zst file to write")
    parser.add_argument("--seed", type=int, default=0, help="shuffling and subsampling seed")
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="largest compressed size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    start = time.perf_counter()

    for source in SOURCES:
        check_installed(source)
    by_source = {}
    for source in SOURCES:
        by_source[source.name] = documents(source)
        docs = by_source[source.name]
        log.info("%-12s %6d documents %10d characters", source.name, len(docs), sum(map(len, docs)))

    kept, raw, packed = build(by_source, seed=args.seed, max_bytes=args.max_bytes)
    for name, docs in kept.items():
        log.info("kept %-12s %6d documents %10d characters", name, len(docs), sum(map(len, docs)))
    versions = {s.name: package_version(s.package) for s in SOURCES}
    write_atomic(args.out, packed)
    write_licences(args.out.parent, versions)
    subsampled = any(len(kept[n]) < len(docs) for n, docs in by_source.items())
    md = corpus_md(
        kept,
        out=args.out,
        raw=raw,
        packed=packed,
        seed=args.seed,
        subsampled=subsampled,
        max_bytes=args.max_bytes,
        versions=versions,
    )
    write_atomic(args.out.parent / "CORPUS.md", md.encode())
    log.info(
        "wrote %s: %d bytes compressed, %d uncompressed, in %.1f s",
        args.out,
        len(packed),
        len(raw),
        time.perf_counter() - start,
    )


if __name__ == "__main__":
    main()
