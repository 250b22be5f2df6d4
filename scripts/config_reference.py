"""Write docs/configuration.md's reference tables from the config dataclasses: defaults, allowed values
(from the field types) and the one-line doc of each field (its inline comment).

    python scripts/config_reference.py          # rewrite the part of docs/configuration.md between the markers
    python scripts/config_reference.py --check  # exit 1 if docs/configuration.md is out of date (tests call this)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))

from dipaco.config import Config  # noqa: E402
from routing.fields import describe, field_hints  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
COMMENT = re.compile(r"^\s+(\w+): .*?\s#\s(.+)$")


def reference() -> str:
    """One table per config section: key, default, allowed values, meaning."""
    parts = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        docs = {m.group(1): m.group(2) for m in map(COMMENT.match, inspect.getsource(cls).splitlines()) if m}
        hints = field_hints(cls)
        parts.append(f"**`{section.name}:`** {inspect.getdoc(cls).splitlines()[0]}\n")
        parts.append("| key | default | allowed | meaning |\n|---|---|---|---|")
        defaults = cls()
        for f in dataclasses.fields(cls):
            allowed = describe(hints[f.name]) or _type(hints[f.name])
            doc = docs.get(f.name, "").replace("|", "/")
            parts.append(f"| `{section.name}.{f.name}` | `{_yaml(getattr(defaults, f.name))}` | {allowed} | {doc} |")
        parts.append("")
    return "\n".join(parts)


def _yaml(value) -> str:
    """A default as it would be written in a YAML config."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _type(hint) -> str:
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
    return getattr(base, "__name__", str(base)).replace("typing.", "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help=f"only check that {PAGE.relative_to(ROOT)} is up to date")
    args = parser.parse_args()
    name = PAGE.relative_to(ROOT)
    page = PAGE.read_text()
    if START not in page or END not in page:
        print(f"{name} lacks the markers {START} ... {END}", file=sys.stderr)
        return 1
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{START}\n{reference()}\n{END}{tail}"
    if args.check:
        if updated != page:
            print(f"{name}'s configuration reference is out of date: run python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
