"""The README stays true: every config field is in its reference, every make target it lists exists."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from dipaco.config import Config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_config_field_is_documented():
    missing = [f"{section.name}.{field.name}"
               for section in dataclasses.fields(Config)
               for field in dataclasses.fields(section.default_factory())
               if f"`{section.name}.{field.name}`" not in README]
    assert not missing, f"README's configuration reference lacks {missing}"


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
