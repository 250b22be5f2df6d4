"""Write docs/configuration.md's reference tables from the config dataclasses' inline comments.

    python scripts/config_reference.py          # rewrite the part of docs/configuration.md between the markers
    python scripts/config_reference.py --check  # exit 1 if docs/configuration.md is out of date (tests call this)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))

from dipaco.config import Config  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
FIELD = re.compile(r"^\s+(\w+): [^=]+? = (.+?)\s+# (.+)$")


def reference() -> str:
    """One table per config section: key, default, meaning."""
    parts = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        parts.append(f"**`{section.name}:`** {inspect.getdoc(cls).splitlines()[0]}\n")
        parts.append("| key | default | meaning |\n|---|---|---|")
        names = {f.name for f in dataclasses.fields(cls)}
        for line in inspect.getsource(cls).splitlines():
            match = FIELD.match(line)
            if match and match.group(1) in names:
                name, default, doc = match.groups()
                default = re.sub(r"field\(default_factory=(?:lambda: )?(.*)\)", r"\1", default).replace("list", "[]")
                parts.append(f"| `{section.name}.{name}` | `{default}` | {doc.replace('|', '/')} |")
        parts.append("")
    return "\n".join(parts)


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
