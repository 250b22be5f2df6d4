"""scripts/build_large_corpus.py on a tiny fake package tree (real .debs built by dpkg-deb, no download):
its documents, duplicate removal, fixed order (a rebuild is byte-identical), manifest and checksums, the
skip of an up-to-date corpus, and the refusal of a corrupt archive by name."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from build_large_corpus import build, manifest_path, up_to_date  # noqa: E402
from debian_debs import AptRecord, parse_stanza  # noqa: E402
from html_text import html_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")

LINE = "An ordinary line of kernel prose that carries some words for the corpus test. {}\n"
C_FILE = "".join(LINE.format(i) for i in range(4))  # ~330 characters: one document, as is
DOC_RST = "Frobbing\n========\n\n" + "".join(LINE.format(f"doc {i}") for i in range(4))
TABLE = "static const u32 fw[] = {\n" + "".join("\t0x0badf00d, 0x12345678, 0xdeadbeef,\n" * 12) + "};\n"
KERNEL = {  # path in the tarball -> text (None: bytes that are not UTF-8)
    "linux-source-6.1/kernel/sched.c": C_FILE,
    "linux-source-6.1/drivers/net/copy.c": C_FILE,  # the same text: one document, labelled by the first path
    "linux-source-6.1/Documentation/frob.rst": DOC_RST,
    "linux-source-6.1/drivers/gpu/asic_reg/regs.h": C_FILE.replace("kernel", "register"),  # generated folder
    "linux-source-6.1/drivers/huge.h": "x" * 200_001 + "\n",  # over the size limit
    "linux-source-6.1/drivers/firmware.h": TABLE,  # mostly hex: a table
    "linux-source-6.1/arch/x86/board.dts": C_FILE.replace("kernel", "device tree"),  # not a kept kind
    "linux-source-6.1/kernel/latin1.c": None,
    "linux-source-6.1/kernel/tiny.c": "int x;\n",  # under 200 characters
}
HTML = """<html><head><title>T</title><script>var hidden = 1;</script></head><body>
<div role="navigation">Navigation text</div>
<div class="body" role="main"><section><h1>The frob module<a class="headerlink" href="#x">¶</a></h1>
<p>The <code>frob</code> module   twiddles things, as its name says, and it does so with enough words
that this paragraph alone is longer than the shortest document the corpus keeps.</p>
<pre>for x in range(3):
    frob(x)</pre></section></div><div class="footer">Footer text</div></body></html>"""
POD = "=head1 NAME\n\nperlfrob - frobbing in Perl\n\n=head1 DESCRIPTION\n\n" + LINE.format("perl") * 3
MAN = b""".TH FROB 2 2024-01-01 "Linux" "System Calls Manual"
.SH NAME
frob \\- twiddle a file descriptor
.SH DESCRIPTION
.BR frob ()
twiddles the file descriptor until it is done, and says so at some length, so that the page
holds more than the two hundred characters a document of the corpus needs to be kept at all.
"""

MAN_DEV = MAN.replace(b" 2 ", b" 3 ").replace(b"until it is done", b"until it is finished")  # not a duplicate


def make_deb(root: Path, package: str, files: dict[str, bytes], out: Path) -> AptRecord:
    """A real .deb of `files` built by dpkg-deb, and the record apt would list for it."""
    tree = root / package
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: 1.0-1\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: t\n")
    for rel, data in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    deb = out / f"{package}_1.0-1_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)],
                   check=True, capture_output=True)
    return AptRecord(package=package, version="1.0-1", sha256=hashlib.sha256(deb.read_bytes()).hexdigest(),
                     size=deb.stat().st_size, filename=f"pool/main/x/{package}/{deb.name}")


def kernel_tarball() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, text in KERNEL.items():
            data = text.encode() if text is not None else "caf\xe9 ".encode("latin-1") * 80
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def copyright_of(package: str) -> dict[str, bytes]:
    return {f"usr/share/doc/{package}/copyright": f"Copyright text of {package}\n".encode()}


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> tuple[Path, dict[str, AptRecord]]:
    """A cache folder of fake .debs for every package the builder reads, and their records."""
    root = tmp_path_factory.mktemp("fake-debs")
    cache = root / "cache"
    cache.mkdir()
    trees = {
        "linux-source-6.1": {"usr/src/linux-source-6.1.tar.xz": kernel_tarball(), **copyright_of("linux-source-6.1")},
        "python3.11-doc": {"usr/share/doc/python3.11/html/library/frob.html": HTML.encode(),
                           "usr/share/doc/python3.11/html/genindex.html": HTML.encode(),
                           **copyright_of("python3.11-doc")},
        "perl-doc": {"usr/share/perl/5.36.0/pod/perlfrob.pod": POD.encode(),
                     "usr/share/perl/5.36.0/pod/perltoc.pod": POD.replace("perlfrob", "perltoc").encode(),
                     **copyright_of("perl-doc")},
        "manpages": {"usr/share/man/man2/frob.2.gz": gzip.compress(MAN), **copyright_of("manpages")},
        "manpages-dev": {"usr/share/man/man3/frob.3.gz": gzip.compress(MAN_DEV)},
    }
    records = {p: make_deb(root / "trees", p, files, cache) for p, files in trees.items()}
    return cache, records


def read_lines(path: Path) -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(open(path, "rb")).read()


@pytest.fixture(scope="module")
def built(packages, tmp_path_factory) -> tuple[Path, dict]:
    cache, records = packages
    out = tmp_path_factory.mktemp("large") / "large_corpus.jsonl.zst"
    return out, build(out=out, records=records, cache_folders=(cache,), seed=0)


def test_documents_are_the_kept_files_text_deduplicated(built):
    out, _ = built
    docs = [json.loads(line) for line in read_lines(out).decode().splitlines()]
    texts = sorted(d["text"] for d in docs)
    kernel_expected = sorted([C_FILE.strip("\n"), DOC_RST.strip("\n")])
    assert sorted(d["text"] for d in docs if d["source"].startswith("linux-")) == kernel_expected
    labels = {d["text"]: d["source"] for d in docs}
    assert labels[C_FILE.strip("\n")] == "linux-drivers"  # drivers/net/copy.c sorts before kernel/sched.c
    assert labels[DOC_RST.strip("\n")] == "linux-docs"
    (python,) = [d["text"] for d in docs if d["source"] == "python-docs"]  # genindex skipped
    assert python.startswith("The frob module\n\nThe frob module twiddles things")
    assert "for x in range(3):\n    frob(x)" in python
    for hidden in ("hidden", "Navigation", "Footer", "¶"):
        assert hidden not in python
    (perl,) = [d["text"] for d in docs if d["source"] == "perl-docs"]  # perltoc skipped
    assert perl == POD.strip("\n")
    if shutil.which("groff"):
        man = [d["text"] for d in docs if d["source"] == "manpages"]
        assert len(man) == 2 and all("twiddles the file descriptor" in t for t in man)
    assert len(texts) == len(set(texts))


def test_manifest_counts_and_checksums_match_the_file(built, packages):
    out, m = built
    raw = read_lines(out)
    _, records = packages
    on_disk = json.loads(manifest_path(out).read_text())
    assert on_disk == m
    assert m["jsonl_sha256"] == hashlib.sha256(raw).hexdigest() and m["jsonl_bytes"] == len(raw)
    assert m["compressed_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert m["compressed_bytes"] == os.stat(out).st_size
    lines = raw.decode().splitlines()
    assert m["documents"] == len(lines) == sum(r["documents"] for r in m["sources"].values())
    assert m["characters"] == sum(len(json.loads(line)["text"]) for line in lines)
    assert m["counts"]["dropped duplicate"] == 1 and m["counts"]["dropped table"] == 1
    assert {p["package"]: (p["version"], p["sha256"]) for p in m["packages"]} == {
        p: (r.version, r.sha256) for p, r in records.items()}
    for p in records:
        licence = (out.parent / "LICENSES" / f"{p}.txt").read_text()
        assert f"Copyright text of {p if p != 'manpages-dev' else 'manpages'}" in licence
    assert m["compressed_sha256"] in (out.parent / "CORPUS.md").read_text()


def test_a_rebuild_is_identical_and_an_up_to_date_corpus_is_not_rebuilt(built, packages, tmp_path):
    first_out, first = built
    cache, records = packages
    out = tmp_path / first_out.name
    again = build(out=out, records=records, cache_folders=(cache,))
    assert again["jsonl_sha256"] == first["jsonl_sha256"]  # the same documents in the same (seeded) order
    assert out.read_bytes() == first_out.read_bytes()
    shutil.rmtree(tmp_path / "extracted")  # an up-to-date corpus needs neither the trees nor the debs
    assert build(out=out, records=records, cache_folders=(tmp_path / "none",)) == again
    assert not (tmp_path / "extracted").exists()
    assert up_to_date(out, again["recipe"])
    assert not up_to_date(out, {**again["recipe"], "seed": 1})  # another seed: rebuilt
    out.write_bytes(out.read_bytes()[:-1] + b"\0")
    assert not up_to_date(out, again["recipe"])  # the file no longer has the manifest's sha256: rebuilt


def test_a_corrupt_archive_is_refused_by_name(packages, tmp_path):
    cache, records = packages
    bad_cache = tmp_path / "cache"
    shutil.copytree(cache, bad_cache)
    deb = bad_cache / "perl-doc_1.0-1_all.deb"
    data = bytearray(deb.read_bytes())
    data[-10] ^= 0xFF
    deb.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=rf"{deb}: SHA256 .* refusing"):
        build(out=tmp_path / "out" / "large_corpus.jsonl.zst", records=records, cache_folders=(bad_cache,))
    assert not (tmp_path / "out" / "large_corpus.jsonl.zst").exists()


def test_apt_stanza_fields():
    text = "Package: x\nVersion: 1:2.0-1\nDescription: a\n more\nSHA256: ab\n\nPackage: x\nVersion: 0\n"
    assert parse_stanza(text) == {"Package": "x", "Version": "1:2.0-1", "Description": "a", "SHA256": "ab"}
    record = AptRecord(package="x", version="1:2.0-1", sha256="ab", size=1, filename="pool/x/x_2.0-1_all.deb")
    assert record.file_names() == ("x_2.0-1_all.deb", "x_1%3a2.0-1_all.deb")


def test_html_without_a_main_element_keeps_the_body():
    blocks = html_blocks("<body><h2>Title</h2><p>one\n two</p><ul><li>item</li></ul><br></body>")
    assert [(b.text, b.heading) for b in blocks] == [("Title", True), ("one two", False), ("item", False)]
