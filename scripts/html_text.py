"""Plain text of an HTML page with the standard library's parser (html.parser): the text of its blocks
(paragraphs, list items, headings, preformatted code), whitespace collapsed except inside <pre>,
without scripts, styles, navigation and Sphinx's "¶" header links. When the page marks its content
(an element with role="main", as Sphinx does) only that content is kept."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import NamedTuple

VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"})
SKIP = frozenset({"script", "style", "head", "nav", "noscript", "template", "svg", "button", "form"})
HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
BLOCKS = HEADINGS | frozenset({
    "p", "div", "pre", "li", "ul", "ol", "dl", "dt", "dd", "table", "tr", "td", "th", "blockquote",
    "section", "article", "header", "footer", "aside", "main", "body", "caption", "figure", "figcaption",
})
_SPACE = re.compile(r"\s+")


class Block(NamedTuple):
    """One block of a page's text."""

    text: str
    heading: bool  # an <h1>..<h6>, or a <dt> (the term an API entry describes)
    main: bool  # inside the page's role="main" element


class _Extractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[Block] = []
        self._stack: list[tuple[str, bool, bool]] = []  # open elements: (tag, skipped, role=main)
        self._buf: list[str] = []

    def _inside(self, tag: str) -> bool:
        return any(t == tag for t, _, _ in self._stack)

    def _flush(self) -> None:
        text = "".join(self._buf)
        self._buf = []
        if self._inside("pre"):
            text = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
        else:
            text = _SPACE.sub(" ", text).strip()
        if text.strip():
            heading = any(t in HEADINGS or t == "dt" for t, _, _ in self._stack)
            self.blocks.append(Block(text, heading, any(m for _, _, m in self._stack)))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in BLOCKS:
            self._flush()
        if tag == "br":
            self._buf.append("\n")
        if tag in VOID:
            return
        attr = {k: v or "" for k, v in attrs}
        skipped = tag in SKIP or "headerlink" in attr.get("class", "").split() or attr.get("role") == "navigation"
        self._stack.append((tag, skipped, attr.get("role") == "main"))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID or not self._inside(tag):
            return
        if tag in BLOCKS:
            self._flush()
        while self._stack and self._stack.pop()[0] != tag:
            pass

    def handle_data(self, data: str) -> None:
        if not any(s for _, s, _ in self._stack):
            self._buf.append(data)


def html_blocks(html: str) -> list[Block]:
    """The page's text blocks in order: those inside role="main" where the page has such an element."""
    parser = _Extractor()
    parser.feed(html)
    parser.close()
    parser._flush()
    main = [b for b in parser.blocks if b.main]
    return main or parser.blocks
