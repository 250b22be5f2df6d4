"""The sources of the large corpus (scripts/build_large_corpus.py), each read from extracted Debian
packages and cut into documents of at most MAX_CHARS characters that never span two files:

- the Linux kernel source (``linux-source-6.1``: C, headers, assembly, Kconfig, Makefiles, scripts and
  the reStructuredText documentation), labelled by top-level folder;
- the Python 3.11 documentation (``python3.11-doc``), its HTML pages reduced to plain text;
- the Perl 5.36 core documentation (``perl-doc``), POD as shipped;
- the Linux man-pages project's pages (``manpages``, ``manpages-dev``) rendered by groff (skipped,
  and said so, where groff is not installed).

Each source yields one ``FileDocs`` per file: its label, its path inside the package and its documents.
"""

from __future__ import annotations

import re
import shutil
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_corpus import _POD_HEADING, PERL_SKIP, TARGET_CHARS, is_rst_heading  # noqa: E402
from corpus_text import Unit, normalise, pack, paragraphs  # noqa: E402
from html_text import html_blocks  # noqa: E402

MAX_CHARS = 3000  # no document is longer (as in the bundled corpus)
KERNEL = "linux-source-6.1"
KERNEL_MAX_FILE = 200_000  # larger kernel files are generated tables (register maps, firmware arrays)
KERNEL_EXTENSIONS = frozenset({".c", ".h", ".S", ".rst", ".txt", ".sh", ".py", ".pl", ".rs"})
KERNEL_NAMES = ("Kconfig", "Makefile", "Kbuild", "README")  # files whose name starts so
KERNEL_SKIP_DIRS = ("/asic_reg/",)  # AMD GPU register headers: generated #define tables, 400 MB
# Top-level folders with a label of their own; the rest (kernel/, mm/, lib/, crypto/, ...) is "linux-core".
KERNEL_GROUPS = {"drivers": "drivers", "arch": "arch", "Documentation": "docs", "fs": "fs", "net": "net",
                 "sound": "sound", "include": "include", "tools": "tools"}
HTML_MAX_FILE = 2_000_000
HTML_SKIP = re.compile(r"(^|/)(genindex[^/]*|search|py-modindex|_static/.*|_sources/.*)$")


class FileDocs(NamedTuple):
    """The documents cut from one file."""

    label: str  # the "source" field of its documents
    path: str  # the file inside its package
    docs: list[str]


@dataclass(frozen=True, kw_only=True)
class LargeSource:
    """One source of the large corpus: its packages, licence and how documents are read."""

    name: str  # short name (labels start with it)
    packages: tuple[str, ...]  # the Debian packages it is read from
    licence: str  # the licence in short (the packages' copyright files are copied whole)
    description: str  # one line for CORPUS.md
    files: Callable[[dict[str, Path]], Iterator[FileDocs]]  # extracted package roots -> documents


def cut(units: list[Unit], sep: str = "\n\n") -> list[str]:
    """The documents of one file: units packed up to MAX_CHARS, a heading starting a new one past TARGET_CHARS."""
    return [d.strip("\n") for d in pack(units, sep=sep, target=TARGET_CHARS, max_chars=MAX_CHARS)]


def top_level(para: str) -> bool:
    """A paragraph that starts at column 0 (a declaration, a comment, a directive): may start a document."""
    return para[:1] not in ("", " ", "\t", "}", ")")


def kernel_label(member: str) -> str:
    parts = member.split("/")
    return "linux-" + (KERNEL_GROUPS.get(parts[1], "core") if len(parts) > 2 else "core")


def kernel_wanted(member: tarfile.TarInfo) -> bool:
    """A regular kernel file of a kept kind, not generated (size, folder)."""
    name = member.name.rsplit("/", 1)[-1]
    kind = Path(name).suffix in KERNEL_EXTENSIONS or name.startswith(KERNEL_NAMES)
    return (member.isfile() and kind and member.size <= KERNEL_MAX_FILE
            and not any(d in member.name for d in KERNEL_SKIP_DIRS))


def kernel_files(roots: dict[str, Path]) -> Iterator[FileDocs]:
    """Every kept file of the kernel tarball, in the tarball's order (read as a stream, not unpacked)."""
    tarballs = sorted((roots[KERNEL] / "usr" / "src").glob("linux-source-*.tar.xz"))
    if len(tarballs) != 1:
        raise SystemExit(f"{roots[KERNEL]}: expected one usr/src/linux-source-*.tar.xz, found {len(tarballs)}")
    with tarfile.open(tarballs[0], mode="r|xz") as tar:
        for member in tar:
            if not kernel_wanted(member):
                continue
            try:
                text = tar.extractfile(member).read().decode("utf-8")
            except UnicodeDecodeError:
                continue  # a few files are Latin-1 or binary: skipped
            paras = paragraphs(normalise(text))
            rst = member.name.endswith(".rst")
            units = [Unit(p, heading=is_rst_heading(p) if rst else top_level(p)) for p in paras]
            yield FileDocs(kernel_label(member.name), member.name, cut(units))


def python_files(roots: dict[str, Path]) -> Iterator[FileDocs]:
    """The Python documentation's HTML pages as plain text, headings and API entries starting documents."""
    html = roots["python3.11-doc"] / "usr" / "share" / "doc" / "python3.11" / "html"
    for path in sorted(html.rglob("*.html")):
        rel = path.relative_to(html).as_posix()
        if HTML_SKIP.search(rel.removesuffix(".html")) or path.stat().st_size > HTML_MAX_FILE:
            continue
        blocks = html_blocks(path.read_text(encoding="utf-8", errors="replace"))
        yield FileDocs("python-docs", rel, cut([Unit(b.text, heading=b.heading) for b in blocks]))


def perl_files(roots: dict[str, Path]) -> Iterator[FileDocs]:
    """The Perl core documentation's POD files, =head1..=head4 starting documents."""
    for path in sorted((roots["perl-doc"] / "usr" / "share" / "perl").glob("5.*/pod/*.pod")):
        if path.name in PERL_SKIP:
            continue
        paras = paragraphs(normalise(path.read_text(encoding="utf-8", errors="replace")))
        yield FileDocs("perl-docs", path.name, cut([Unit(p, heading=bool(_POD_HEADING.match(p))) for p in paras]))


def man_files(roots: dict[str, Path]) -> Iterator[FileDocs]:
    """The man pages of manpages and manpages-dev rendered by groff; none (said by the builder) without groff."""
    if shutil.which("groff") is None:
        return
    from build_manpages_corpus import page_units, render

    for package in ("manpages", "manpages-dev"):
        man = roots[package] / "usr" / "share" / "man"
        for page in sorted(p for p in man.glob("man[0-9]*/*.gz") if p.is_file() and not p.is_symlink()):
            text = render(page)
            if text:
                yield FileDocs("manpages", page.relative_to(man).as_posix(), cut(page_units(text)))


SOURCES = (
    LargeSource(name="linux", packages=(KERNEL,), licence="GPL-2.0 (some files dual-licensed; SPDX tags in each)",
                description="the Linux 6.1 kernel source with Debian's patches: .c .h .S .rs .rst .txt .sh .py .pl, "
                f"Kconfig, Makefile, Kbuild, README files up to {KERNEL_MAX_FILE:,} bytes, without the generated "
                "AMD GPU register headers (asic_reg/); labelled by top-level folder",
                files=kernel_files),
    LargeSource(name="python-docs", packages=("python3.11-doc",), licence="PSF License Agreement",
                description="the Python 3.11 documentation's HTML pages as plain text (html.parser; the page's "
                "role=main content; no index or search pages)", files=python_files),
    LargeSource(name="perl-docs", packages=("perl-doc",), licence="GPL-1+ or the Artistic License",
                description=f"the Perl 5.36 core documentation in POD (without {', '.join(sorted(PERL_SKIP))})",
                files=perl_files),
    LargeSource(name="manpages", packages=("manpages", "manpages-dev"),
                licence="the man-pages project's licences (mostly verbatim-copying, some GPL/BSD)",
                description="the Linux man-pages project's pages, all sections, rendered by groff to plain text",
                files=man_files),
)
