"""Build a second, less separable real corpus: the Linux man-pages project's manual pages, rendered to
plain text, in three sources that share most of their vocabulary (C, POSIX, the kernel):

- ``syscalls``  section 2, system calls (Debian package manpages-dev);
- ``libc``      section 3, C library functions and types (manpages-dev);
- ``overviews`` sections 4, 5 and 7: devices, file formats, overviews and conventions (manpages).

Unlike the demo corpus (Bible / Python / Perl), a 32-token prefix does not tell these apart well:
open(2), fopen(3) and path_resolution(7) use the same words. Every page is rendered with
``groff -t -man -Tutf8`` (no bold or underline), its running header and footer dropped, cut at its
section headings (NAME, SYNOPSIS, DESCRIPTION, ...) into documents of at most 3,000 characters with
the demo corpus's packing (`build_corpus.pack`), shuffled and written as zstd JSON lines
``{"text": ..., "source": ...}``. Pages that only include another (``.so``) are skipped.

    apt-get install manpages manpages-dev groff-base    # once (usually there already)
    python scripts/build_manpages_corpus.py             # or: make corpus-manpages (about 1-2 min)

Writes data/manpages.jsonl.zst (not committed; configs/manpages.yaml reads it) and next to it
manpages-CORPUS.md (counts and the packages' versions) and manpages-LICENSE.txt (Debian's copyright
file of the man-pages project).
"""

from __future__ import annotations

import argparse
import gzip
import logging
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_corpus import (  # noqa: E402
    MIN_CHARS,
    TARGET_CHARS,
    compress,
    package_version,
    serialise,
    write_atomic,
)
from corpus_text import Unit, normalise, pack, paragraphs  # noqa: E402

log = logging.getLogger("build_manpages_corpus")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "data" / "manpages.jsonl.zst"
MAX_CHARS = 3000
SECTIONS = {"syscalls": ("manpages-dev", ("2",)), "libc": ("manpages-dev", ("3",)),
            "overviews": ("manpages", ("4", "5", "7"))}
COPYRIGHT = Path("/usr/share/doc/manpages/copyright")
_HEADING = re.compile(r"^[A-Z][A-Z0-9 ,/()-]*$")


def package_pages(package: str, sections: tuple[str, ...]) -> list[Path]:
    """The package's man pages of `sections` (real files, not links), sorted."""
    done = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"Debian package {package} is not installed: apt-get install {package}")
    pattern = re.compile(rf"/usr/share/man/man({'|'.join(sections)})/[^/]+\.\1[a-z]*\.gz$")
    return sorted(p for p in map(Path, done.stdout.split()) if pattern.search(str(p)) and p.is_file()
                  and not p.is_symlink())


def render(page: Path) -> str | None:
    """The page as plain text (groff, tbl, 80 columns, no overstriking), None for a `.so` include."""
    source = gzip.decompress(page.read_bytes())
    if source.lstrip().startswith(b".so "):
        return None
    done = subprocess.run(["groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=80n"], input=source,
                          capture_output=True, check=False)
    text = done.stdout.decode("utf-8", errors="replace")
    lines = text.splitlines()[1:-1]  # the running header ("open(2)  System Calls Manual  open(2)") and footer
    return normalise("\n".join(line[7:] if line.startswith("       ") else line for line in lines))


def page_units(text: str) -> list[Unit]:
    """Blank-line paragraphs; an all-caps line at column 0 (a section heading) starts a unit of its own."""
    return [Unit(p, heading=bool(_HEADING.match(p.split("\n", 1)[0]))) for p in paragraphs(text)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the .jsonl.zst file to write")
    parser.add_argument("--seed", type=int, default=0, help="shuffling seed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    started = time.perf_counter()
    by_source: dict[str, list[str]] = {}
    for name, (package, sections) in SECTIONS.items():
        docs, pages = [], 0
        for page in package_pages(package, sections):
            text = render(page)
            if not text:
                continue
            pages += 1
            for doc in pack(page_units(text), sep="\n\n", target=TARGET_CHARS, max_chars=MAX_CHARS):
                if len(doc.strip()) >= MIN_CHARS:
                    docs.append(doc.strip("\n"))
        by_source[name] = docs
        log.info("%-10s %5d pages %6d documents %10d characters", name, pages, len(docs), sum(map(len, docs)))
    mixed = [(name, d) for name, docs in by_source.items() for d in docs]
    random.Random(args.seed).shuffle(mixed)
    raw = serialise(mixed)
    packed = compress(raw)
    write_atomic(args.out, packed)
    versions = {p: package_version(p) for p in ("manpages", "manpages-dev")}
    rows = "\n".join(f"| `{name}` | {SECTIONS[name][0]} {versions[SECTIONS[name][0]]} | "
                     f"{', '.join(SECTIONS[name][1])} | {len(docs):,} | {sum(map(len, docs)):,} |"
                     for name, docs in by_source.items())
    write_atomic(args.out.with_name("manpages-CORPUS.md"), (
        f"# The man-pages corpus\n\n`{args.out.name}`: {len(mixed):,} documents built by "
        f"`scripts/build_manpages_corpus.py --seed {args.seed}` ({len(packed):,} bytes compressed).\n\n"
        "| source | Debian package | sections | documents | characters |\n|---|---|---|---:|---:|\n"
        f"{rows}\n\nLicence: the man-pages project's (see manpages-LICENSE.txt, Debian's copyright file).\n"
    ).encode())
    write_atomic(args.out.with_name("manpages-LICENSE.txt"), COPYRIGHT.read_bytes())
    log.info("wrote %s (%d documents, %d bytes) in %.0f s", args.out, len(mixed), len(packed),
             time.perf_counter() - started)


if __name__ == "__main__":
    main()
