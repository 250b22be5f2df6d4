"""The README, docs/ and experiments/ stay true: the config reference is generated and complete, the make
targets and files they name exist, and every results file says where its figures come from."""

import dataclasses
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
               if not name.with_suffix(".json").exists() or not name.with_suffix(".md").exists()]
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


RESULTS_PATH = re.compile(r"\b((?:bench|experiments)/results/[\w-]+)\.(?:json|md|png)\b")
LINK_TARGET = re.compile(r"\]\(([^)#\s]+)")


def quoted_results(doc: Path, text: str) -> set[Path]:
    """The results files (paths without their suffix) a piece of `doc` quotes: links into a results folder,
    relative to the doc, and results paths written from the repository root."""
    found = {ROOT / path for path in RESULTS_PATH.findall(text)}
    for target in LINK_TARGET.findall(text):
        path = (doc.parent / target).resolve()
        if path.parent in RESULTS_DIRS:
            found.add(path.with_suffix(""))
    return found
