"""The README, docs/ and experiments/ stay true: the config reference is generated and complete, the make
targets and files they name exist, every results file says where its figures come from, every figure a
page quotes next to a results file is in that file (in a table row that names a results row, in that row
and column), and none is quoted from a tree with local changes
beyond the files listed to be measured again (`DIRTY_QUOTED`)."""

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

from dipaco.config import Config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = {path: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
EXPERIMENT_PAGES = {path: path.read_text() for path in sorted((ROOT / "experiments").glob("*.md"))}
DOCS = {ROOT / "README.md": README, **PAGES, **EXPERIMENT_PAGES}
RESULTS_DIRS = (ROOT / "bench" / "results", ROOT / "experiments" / "results")


def test_every_config_field_is_documented():
    reference = PAGES[ROOT / "docs" / "configuration.md"]
    missing = [f"{section.name}.{field.name}"
               for section in dataclasses.fields(Config)
               for field in dataclasses.fields(section.default_factory())
               if f"`{section.name}.{field.name}`" not in reference]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_config_reference_is_generated_from_the_code():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_listed_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, flags=re.M))
    listed = set(re.findall(r"^\| `make ([a-z-]+)", README, flags=re.M))
    assert listed and listed <= targets, listed - targets


def test_setup_commands_are_shown():
    assert "make install" in README and "make test" in README and "make demo" in README


def test_every_docs_page_is_linked_from_the_readme():
    unlinked = [path.name for path in PAGES if f"](docs/{path.name})" not in README]
    assert not unlinked, f"README links no {unlinked}"


def test_relative_links_point_to_files():
    broken = []
    for path, text in DOCS.items():
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_quoted_results_files_exist():
    named = {name for doc, text in DOCS.items() for name in quoted_results(doc, text)}
    assert named, "README, docs/ and experiments/ quote no results file"
    missing = [str(name.relative_to(ROOT)) for name in named
               if not file_of(name, ".json").exists() or not file_of(name, ".md").exists()]
    assert not missing, f"pages quote results files whose .json or .md does not exist: {sorted(missing)}"


def test_every_results_file_says_where_its_figures_come_from():
    files = sorted(path for folder in RESULTS_DIRS for path in folder.glob("*.json"))
    assert files
    for path in files:
        record = json.loads(path.read_text())
        lacking = [key for key in ("source", "reproduce", "machine") if not record.get(key)]
        assert not lacking, f"{path.relative_to(ROOT)} lacks {lacking}"
        markdown = path.with_suffix(".md")
        assert markdown.exists(), f"{path.relative_to(ROOT)} has no {markdown.name}"
        assert "Source: " in markdown.read_text(), f"{markdown.relative_to(ROOT)} does not say where its figures come from"


# Quoting a figure (docs/benchmarks.md#quoting-a-figure): a figure sits in a sentence that links its results
# file or names it (`bench/results/<name>.md`), or after such a sentence in the same paragraph, or in a table
# row that names it; a table or code block whose row names none takes the files of the paragraph just
# above it. Each figure there must be in one of those files.
RESULTS_PATH = re.compile(r"\b((?:bench|experiments)/results/[\w.-]+?)\.(?:json|md|png)\b")
LINK_TARGET = re.compile(r"\]\(([^)#\s]+)")
# A figure: a number with a decimal point or thousands separators (a plain integer is mostly a setting:
# 4 paths, 32 tokens, 10 rounds), outside `code` and link targets; not part of a version (2.13.0).
FIGURE = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w.]*\d)")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\[(`*_\"])")
ABBREVIATIONS = ("e.g.", "i.e.", "cf.", "vs.")


def file_of(name: Path, suffix: str) -> Path:
    """A results file of `name` (a path without its suffix, which may hold dots: dense4x-lr1.5e-3)."""
    return name.parent / (name.name + suffix)


def quoted_results(doc: Path, text: str) -> set[Path]:
    """The results files (paths without their suffix) a piece of `doc` quotes: links into a results folder,
    relative to the doc, and results paths written from the repository root."""
    found = {ROOT / path for path in RESULTS_PATH.findall(text)}
    for target in LINK_TARGET.findall(text):
        path = (doc.parent / target).resolve()
        if path.parent in RESULTS_DIRS:
            found.add(path.with_suffix(""))
    return found


def sentences(paragraph: str) -> list[str]:
    """A paragraph split into sentences (not after e.g., i.e., cf., vs.)."""
    out: list[str] = []
    for piece in SENTENCE_END.split(paragraph):
        if out and out[-1].endswith(ABBREVIATIONS):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


def quoting_units(doc: Path, text: str) -> list[tuple[int, str, set[Path]]]:
    """(line, text, results files) for every sentence, table row and code line of `doc` that quotes a
    results file: a sentence the files named in its paragraph up to its end, a row or code line its own
    or those of the paragraph just above its table or block."""
    units: list[tuple[int, str, set[Path]]] = []
    paragraph: list[str] = []
    start = 0
    above: set[Path] = set()  # the files named by the paragraph before the current table or code block
    in_code = False

    def flush() -> None:
        nonlocal paragraph, above
        if paragraph:
            above = set()
            for sentence in sentences(" ".join(line.strip() for line in paragraph)):
                above = above | quoted_results(doc, sentence)
                units.append((start, sentence, above))
        paragraph = []

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            flush()
            in_code = not in_code
        elif in_code or line.lstrip().startswith("|"):
            flush()
            units.append((number, line, quoted_results(doc, line) or above))
        elif not line.strip() or line.startswith("#"):
            flush()
            if line.startswith("#"):
                above = set()
        else:
            if re.match(r"\s*(?:[-*]|\d+\.) ", line):  # a list item starts a paragraph of its own
                flush()
            if not paragraph:
                start = number
            paragraph.append(line)
    flush()
    return [unit for unit in units if unit[2]]


def figures(text: str) -> list[str]:
    """The figures of a piece of text, outside `code` and link targets."""
    text = re.sub(r"`[^`]*`", " ", re.sub(r"\]\([^)]*\)", "]", text))
    return FIGURE.findall(text)


@functools.cache
def results_numbers(name: Path) -> tuple[str, tuple[float, ...]]:
    """A results file's markdown and JSON text, and every number in its JSON."""
    text = "".join(path.read_text() for path in (file_of(name, ".md"), file_of(name, ".json")) if path.exists())
    values: list[float] = []

    def walk(item) -> None:
        if isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            values.append(float(item))

    if file_of(name, ".json").exists():
        walk(json.loads(file_of(name, ".json").read_text()))
    return text, tuple(values)


def holds(figure: str, name: Path) -> bool:
    """Whether a results file has `figure`: written so in its text, or a JSON number that rounds to it
    (as a fraction, also x 100: a percentage). Signs are not compared (lower / higher say them)."""
    text, values = results_numbers(name)
    if re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d]|,\d)", text):
        return True
    value = float(figure.replace(",", ""))
    half_unit = 0.5 * 10 ** -(len(figure.split(".")[1]) if "." in figure else 0)
    return any(abs(abs(v) * scale - value) <= half_unit + 1e-9 for v in values for scale in (1, 100))


# A table row that names a results table's row and columns is a table lookup: a row whose label (first
# cell) is a row label of a results table of its files, in a table with two or more of that results
# table's column names, has each figure under one of those columns in that column of that row
# (docs/benchmarks.md#quoting-a-figure); its other figures, and every other figure, as above.
def table_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def label(cell: str) -> str:
    """A row label or column name as compared: without emphasis, code marks and case."""
    return cell.replace("**", "").replace("`", "").strip().lower()


def markdown_tables(text: str) -> list[tuple[list[str], list[tuple[int, list[str]]]]]:
    """Every table of a markdown text: (its column names, [(line, cells)] of its rows)."""
    tables: list = []
    last = -1
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("|"):
            continue
        cells = table_cells(line)
        if number != last + 1:
            tables.append(([label(c) for c in cells], []))
        elif not set("".join(cells)) <= set("-: "):
            tables[-1][1].append((number, cells))
        last = number
    return tables


@functools.cache
def results_rows(name: Path) -> dict[str, list[dict[str, str]]]:
    """A results file's markdown table rows by their label: {column name: cell} each."""
    md = file_of(name, ".md")
    rows: dict[str, list[dict[str, str]]] = {}
    for names, table in markdown_tables(md.read_text()) if md.exists() else []:
        for _, cells in table:
            rows.setdefault(label(cells[0]), []).append(dict(zip(names, cells)))
    return rows


CELL_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def cell_holds(figure: str, cell: str) -> bool:
    """Whether a results table's cell holds `figure`: a number in it that rounds to it (2400 holds 2,400)."""
    value = float(figure.replace(",", ""))
    half_unit = 0.5 * 10 ** -(len(figure.split(".")[1]) if "." in figure else 0)
    return any(abs(float(n.replace(",", "")) - value) <= half_unit + 1e-9 for n in CELL_NUMBER.findall(cell))


def looked_up_figures(doc: Path, text: str) -> tuple[list[str], set[tuple[int, str]]]:
    """(messages, the (line, figure)s looked up) for `doc`'s table rows that name a results row and columns:
    each figure under a named column must be in that row's cell of that column."""
    files = {line: found for line, unit, found in quoting_units(doc, text) if unit.lstrip().startswith("|")}
    wrong, looked_up = [], set()
    for names, rows in markdown_tables(text):
        for line, cells in rows:
            theirs = [row for name in sorted(files.get(line, ())) for row in results_rows(name).get(label(cells[0]), [])
                      if len(set(names[1:]) & set(row)) >= 2]
            wanted = [(column, f) for column, cell in zip(names[1:], cells[1:]) if any(column in r for r in theirs)
                      for f in figures(cell)]
            looked_up |= {(line, f) for _, f in wanted}
            for column, figure in wanted:
                if not any(cell_holds(figure, row.get(column, "")) for row in theirs):
                    wrong.append(f"{doc.relative_to(ROOT)}:{line}: {figure} is not the results row "
                                 f"{cells[0]!r}'s {column!r} in {sorted(str(n.relative_to(ROOT)) for n in files[line])}")
    return wrong, looked_up


def wrong_figures(doc: Path, text: str) -> list[str]:
    misplaced, looked_up = looked_up_figures(doc, text)
    return misplaced + [f"{doc.relative_to(ROOT)}:{line}: {figure} is in none of "
                        f"{sorted(str(name.relative_to(ROOT)) for name in files)}"
                        for line, unit, files in quoting_units(doc, text)
                        for figure in figures(unit)
                        if (line, figure) not in looked_up and not any(holds(figure, name) for name in files)]


def test_quoted_figures_are_in_their_results_files():
    checked = sum(len(figures(unit)) for doc, text in DOCS.items() for _, unit, _ in quoting_units(doc, text))
    assert checked > 600, f"only {checked} figures sit next to a results file: is the convention still followed?"
    wrong = [message for doc, text in DOCS.items() for message in wrong_figures(doc, text)]
    assert not wrong, "figures not in the results files they are quoted with:\n" + "\n".join(wrong)


def test_a_changed_digit_fails_the_figure_check():
    """The check bites: the README's first checked table row with one digit of its first figure changed."""
    doc = ROOT / "README.md"
    row = next(unit for _, unit, _ in quoting_units(doc, README) if figures(unit) and unit.startswith("|"))
    figure = figures(row)[0]
    changed = figure[:-1] + str((int(figure[-1]) + 1) % 10)
    mutated = README.replace(row, row.replace(figure, changed, 1), 1)
    assert not wrong_figures(doc, README)
    assert any(f": {changed} is in none of" in message for message in wrong_figures(doc, mutated)), (figure, changed)


def test_a_figure_from_another_row_or_column_fails_the_table_lookup():
    """docs/islands.md's measured table names bench/results/islands.md's rows and columns: the straggler row's
    goodput by time (86.2%) put under goodput by work, or sync-slow's goodput (33.0%) in async-slow's row, is
    in the results file (the check by value alone passes it) but not in that row and column."""
    doc = ROOT / "docs" / "islands.md"
    text = PAGES[doc]
    row = next(line for line in text.splitlines() if line.startswith("| async-slow |"))
    cells = table_cells(row)
    assert cells[3:6] == ["81.0%", "81.0%", "86.2%"]  # goodput (by work), simulator (by work), goodput by time
    swapped = row.replace("| 81.0% | 81.0% | 86.2% |", "| 86.2% | 81.0% | 81.0% |")
    moved = row.replace("| 81.0% | 81.0% |", "| 33.0% | 81.0% |")
    assert not wrong_figures(doc, text)
    for mutated, figure in ((swapped, "86.2"), (moved, "33.0")):
        assert holds(figure, ROOT / "bench" / "results" / "islands")  # by value alone it would pass
        wrong = wrong_figures(doc, text.replace(row, mutated))
        assert any(f": {figure} is not the results row 'async-slow''s 'goodput (by work)'" in w for w in wrong), wrong


# Quoted from a tree with local changes: the results files below were recorded from a tree with local changes
# (source "... at commit 6db885c+local changes ...") and the README or docs quote figures from them today.
# Each must be measured again from a clean tree (bench/recording.py records `clean`) and then leave this list;
# no file may join it: a figure newly quoted from a dirty tree fails the test.
DIRTY_QUOTED = frozenset({
    "bench/results/demo-private-emb",
    "bench/results/grid256",
    "bench/results/huge-document",
    "experiments/results/quality-private-emb-full-6db885c",  # the demo's quality before its clean re-measurement: the recipe log's history
    "experiments/results/quality-private-emb-full-budget4-6db885c",  # 4x the demo's budget before its clean re-measurement: the recipe log's history
    "experiments/results/quality-private-emb-seed1",
    "bench/results/routing",
    "bench/results/routing-1m",
    "experiments/results/capacity-decay-avg",
    "experiments/results/capacity-decay-avg-labels",
    "experiments/results/capacity-likelihood",
    "experiments/results/demo-decay-avg",
    "experiments/results/islands-target",
    "experiments/results/quality-budget4",
    "experiments/results/quality-manpages-decay-avg-budget4",
    "experiments/results/quality-manpages-private-emb-budget4",
    "experiments/results/quality-private-emb",
    "experiments/results/quality-reduced",
    "experiments/results/quality-reduced-wsd-average-budget4",
    "experiments/results/quality-reduced-wsd-nesterov-budget4",
    "experiments/results/quality-w50h10",
    "experiments/results/quality-w50h10-budget4",
})


def quoted_from_dirty_trees(docs: dict[Path, str]) -> dict[str, list[str]]:
    """Results file -> the places whose figures only it (or other files not `quotable`) holds, for every
    results file recorded from a dirty tree (or read models trained from one)."""
    found: dict[str, list[str]] = {}
    for doc, text in docs.items():
        for line, unit, files in quoting_units(doc, text):
            for figure in figures(unit):
                holding = [name for name in sorted(files) if holds(figure, name)]
                if holding and not any(quotable_file(name) for name in holding):
                    for name in holding:
                        found.setdefault(str(name.relative_to(ROOT)), []).append(f"{doc.relative_to(ROOT)}:{line}")
    return found


@functools.cache
def quotable_file(name: Path) -> bool:
    from bench.recording import quotable

    return quotable(json.loads(file_of(name, ".json").read_text()))


def test_no_figure_is_quoted_from_a_dirty_tree():
    found = quoted_from_dirty_trees(DOCS)
    new = {name: places for name, places in found.items() if name not in DIRTY_QUOTED}
    assert not new, f"figures quoted from results recorded from a tree with local changes: {new}"
    stale = sorted(DIRTY_QUOTED - set(found))
    assert not stale, f"{stale} are no longer quoted from a dirty tree: take them off DIRTY_QUOTED"


def test_a_quote_of_a_dirty_results_file_is_reported():
    """The check bites: a page quoting a figure of a file recorded with local changes names it."""
    name = ROOT / "experiments" / "results" / "quality-private-emb-seed1"
    assert not quotable_file(name)
    page = ROOT / "docs" / "page.md"
    text = "DiPaCo reaches 97.29 ([results](../experiments/results/quality-private-emb-seed1.md)).\n"
    assert quoted_from_dirty_trees({page: text}) == {"experiments/results/quality-private-emb-seed1": ["docs/page.md:1"]}
