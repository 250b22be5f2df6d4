"""Text clean-up and packing for the corpus builders (scripts/build_corpus.py, build_manpages_corpus.py):
units of text (a heading may start a new document) grouped greedily into documents of bounded length,
cut at paragraph, line, then word boundaries where a unit is too long."""

import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple


class Unit(NamedTuple):
    """A piece of text that is kept whole where it fits; a heading may start a new document."""

    text: str
    heading: bool = False


def normalise(text: str) -> str:
    """Unix newlines, no trailing spaces, runs of 3+ blank lines collapsed to 2."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    return re.sub(r"\n{4,}", "\n\n\n", text)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, indented ones (code, directive bodies) joined to the one
    before, so an explanation stays with its example where it fits."""
    out: list[str] = []
    parts = re.split(r"(\n(?:[ \t]*\n)+)", text.strip("\n"))  # [para, blank lines, para, ...]
    for para, gap in zip(parts[::2], [""] + parts[1::2], strict=True):
        if out and para[:1] in (" ", "\t"):
            out[-1] += gap + para  # keeps the blank lines inside a code block as they were
        else:
            out.append(para)
    return out


def split_long(text: str, max_chars: int, seps: tuple[str, ...] = ("\n\n", "\n", " ")) -> list[str]:
    """Cut text longer than max_chars at paragraph, then line, then word boundaries."""
    if len(text) <= max_chars:
        return [text]
    if not seps:
        return [text[i : i + max_chars] for i in range(0, len(text), max_chars)]
    sep, pieces = seps[0], []
    for part in text.split(sep):
        pieces.extend(split_long(part, max_chars, seps[1:]))
    return list(pack_text(pieces, sep=sep, max_chars=max_chars))


def pack_text(pieces: Iterable[str], *, sep: str, max_chars: int) -> Iterator[str]:
    """Greedily join pieces (each <= max_chars) with sep into chunks of at most max_chars."""
    yield from pack((Unit(p) for p in pieces), sep=sep, target=max_chars, max_chars=max_chars)


def pack(units: Iterable[Unit], *, sep: str, target: int, max_chars: int) -> Iterator[str]:
    """Group units into documents of at most max_chars: a heading closes the current document once
    it holds `target` characters; an over-long unit is cut by split_long."""
    buf: list[str] = []
    size = 0
    for unit in units:
        for i, piece in enumerate(split_long(unit.text, max_chars)):
            grown = size + len(sep) + len(piece) if buf else len(piece)
            if buf and ((unit.heading and i == 0 and size >= target) or grown > max_chars):
                yield sep.join(buf)
                buf, grown = [], len(piece)
            buf.append(piece)
            size = grown
    if buf:
        yield sep.join(buf)
