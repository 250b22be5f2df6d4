"""The bundled demo corpus: about 14k real documents from three sources (King James Bible, Python
3.11 docs in reST, Perl 5.36 docs in POD) as zstd-compressed JSON lines ``{"text", "source"}``.
See CORPUS.md next to this file for what is in it and LICENSES/ for each source's licence.

Load it like any user corpus:

    import datasets
    from dipaco.data import demo_corpus_path
    ds = datasets.load_dataset("json", data_files=str(demo_corpus_path()), split="train")

Rebuild it with ``make corpus`` (``python scripts/build_corpus.py``).
"""

from pathlib import Path

DEMO_CORPUS_NAME = "demo_corpus.jsonl.zst"


def demo_corpus_path() -> Path:
    """Path of the bundled demo corpus; FileNotFoundError naming the path if it was not built."""
    path = Path(__file__).resolve().parent / DEMO_CORPUS_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"the bundled demo corpus {path} is missing; build it with `make corpus` "
            "(python scripts/build_corpus.py, needs the Debian packages bible-kjv python3.11-doc perl-doc)"
        )
    return path
