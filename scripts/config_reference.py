"""Write the README's configuration reference from the config dataclasses' inline comments.

    python scripts/config_reference.py          # rewrite the section of README.md between the markers
    python scripts/config_reference.py --check  # exit 1 if README.md is out of date (tests call this)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    parser.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    args = parser.parse_args()
    readme = (ROOT / "README.md").read_text()
    if START not in readme or END not in readme:
        print(f"README.md lacks the markers {START} ... {END}", file=sys.stderr)
        return 1
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{START}\n{reference()}\n{END}{tail}"
    if args.check:
        if updated != readme:
            print("README.md's configuration reference is out of date: run python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    (ROOT / "README.md").write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
