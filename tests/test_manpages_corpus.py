"""scripts/build_manpages_corpus.py renders a man page to plain text cut at its section headings."""

from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from build_manpages_corpus import page_units, render  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff (groff-base)")

PAGE = rb""".TH FROB 2 2024-01-01 "Linux" "System Calls Manual"
.SH NAME
frob \- twiddle a file descriptor
.SH DESCRIPTION
.BR frob ()
twiddles
.I fd
until it is done.
.PP
A second paragraph.
.SH RETURN VALUE
Zero on success.
"""


def write_page(tmp_path: Path, name: str, source: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(gzip.compress(source))
    return path


def test_a_page_becomes_plain_text_cut_at_its_headings(tmp_path):
    text = render(write_page(tmp_path, "frob.2.gz", PAGE))
    assert "frob - twiddle a file descriptor" in text.replace("\u2010", "-")
    assert "FROB(2)" not in text  # the running header and footer are dropped
    assert "\x08" not in text and "\x1b" not in text  # no overstriking or colour
    units = page_units(text)
    assert [u.text.split("\n")[0] for u in units if u.heading] == ["NAME", "DESCRIPTION", "RETURN VALUE"]
    body = next(u.text for u in units if u.text.startswith("DESCRIPTION"))
    assert "frob() twiddles fd until it is done." in " ".join(body.split())


def test_an_include_only_page_is_skipped(tmp_path):
    assert render(write_page(tmp_path, "alias.2.gz", b".so man2/frob.2\n")) is None
