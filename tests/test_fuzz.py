"""Property-based checks (issue 13, item 10): over config values and corpus lines, dipaco gives a clear
error or a correct result, never a traceback. A "clear error" is the exception type the command turns
into one line (ValueError, FileNotFoundError); anything else is a failure here.

Corpus examples go through `datasets` (a fraction of a second each), so those properties run a few
dozen examples; the config ones a few hundred. `make test` runs the same examples every time
(`derandomize`); to explore new ones: `HYPOTHESIS_PROFILE=default pytest tests/test_fuzz.py`."""

import dataclasses
import json
import math
import os
import typing

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dipaco.config import Config, load_config, save_config
from routing.corpus import load_corpus

settings.register_profile("dipaco", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dipaco"))


def config_keys() -> list[str]:
    hints = typing.get_type_hints(Config)
    return [f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
            for f in dataclasses.fields(hints[section.name])]


KEYS = config_keys()
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.dictionaries(st.text(max_size=4), SCALARS, max_size=2))


def all_floats_finite(config: Config) -> bool:
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(getattr(config, section.name)):
            value = getattr(getattr(config, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                return False
    return True


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_value_for_any_key_is_a_config_or_a_clear_error(key, value):
    try:
        config = load_config(None, [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"])
    except ValueError as err:
        assert key in str(err) or "override" in str(err) or "must" in str(err), err
        return
    assert all_floats_finite(config)
    assert isinstance(config.to_dict(), dict)


def assert_a_config_that_reads_back(config: Config, folder) -> None:
    """A config that loaded is whole and usable: finite numbers, and the config.yaml `save_config` writes
    of it (what islands and later stages read) loads back as the same config."""
    assert isinstance(config, Config) and all_floats_finite(config)
    save_config(config, folder / "saved.yaml")
    assert load_config(folder / "saved.yaml") == config


def assert_only_these_keys_differ_from_the_defaults(config: Config, keys: set[tuple[str, str]]) -> None:
    """What the text did not set holds its default."""
    got, default = config.to_dict(), Config().to_dict()
    for section, key in keys:
        del got[section][key], default[section][key]
    assert got == default


# text, and text shaped like an override of a real key or a config file of real sections (most of which load)
OVERRIDE_TEXT = st.one_of(st.text(max_size=30), st.builds("{}={}".format, st.sampled_from(KEYS), st.text(max_size=8)))


def config_yaml(items: list[tuple[str, object]]) -> str:
    raw: dict[str, dict] = {}
    for key, value in items:
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return yaml.safe_dump(raw)


FILE_TEXT = st.one_of(st.text(max_size=200), st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4).map(config_yaml))


@settings(max_examples=200, deadline=None)
@given(text=OVERRIDE_TEXT)
@example(text="inner.lr=1e-3")  # loads: so the checks of a loaded config run every time
@example(text="topology.levels=[3, 2]")
@example(text="routing.hf_model=")
def test_any_override_text_is_a_config_or_a_clear_error(tmp_path_factory, text):
    try:
        config = load_config(None, [text])
    except ValueError as err:  # one line naming the override, or the key it set
        section = text.partition("=")[0].split(".")[0]
        assert "\n" not in str(err) and ("override" in str(err) or section in str(err)), err
        return
    assert_a_config_that_reads_back(config, tmp_path_factory.mktemp("override"))
    assert_only_these_keys_differ_from_the_defaults(config, {tuple(text.partition("=")[0].split("."))})


@settings(max_examples=100, deadline=None)
@given(text=FILE_TEXT)
@example(text="")  # an error naming the file: an empty config is not the defaults
@example(text="inner:\n  steps: 7\nouter:\n  lr: 0.5\n")
@example(text="# a comment only\n")  # the same
def test_any_config_file_text_is_a_config_or_a_clear_error(tmp_path_factory, text):
    folder = tmp_path_factory.mktemp("cfg")
    path = folder / "config.yaml"
    path.write_text(text)
    try:
        config = load_config(path)
    except ValueError as err:
        assert str(path) in str(err), err  # names the file
        return
    assert_a_config_that_reads_back(config, folder)
    raw = yaml.safe_load(text) or {}
    assert_only_these_keys_differ_from_the_defaults(config, {(s, k) for s, keys in raw.items() for k in keys or {}})


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
                              st.text(max_size=20)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                    max_leaves=6)
DOCUMENT = st.fixed_dictionaries({"text": st.one_of(st.text(max_size=40), st.none())},
                                 optional={"source": st.text(max_size=8)})
LINE = st.one_of(DOCUMENT.map(json.dumps), DOCUMENT.map(lambda d: json.dumps(d, ensure_ascii=False)),
                 JSON.map(json.dumps), st.text(max_size=30))
CORPUS_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def load(tmp_path_factory, name: str, data: bytes):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / name).write_bytes(data)
    return load_corpus(path=str(folder / name), cache_dir=str(folder / "cache"))


@CORPUS_SETTINGS
@given(lines=st.lists(LINE, max_size=6), encoding=st.sampled_from(["utf-8", "latin-1", "utf-16"]))
@example(lines=["null", '{"text": "a"}'], encoding="utf-8")  # pyarrow segfaulted on a first line `null`
@example(lines=['{"text": "0"}', '{"text": null, "source": "\x80"}'], encoding="latin-1")
def test_any_jsonl_lines_are_documents_or_a_clear_error(tmp_path_factory, lines, encoding):
    data = "\n".join(lines).encode(encoding, errors="replace")
    try:
        ds = load(tmp_path_factory, "docs.jsonl", data)
    except (ValueError, FileNotFoundError):
        return
    # pyarrow accepts a stray non-UTF-8 byte outside the text field (the row's text is what matters)
    objects = [json.loads(line) for line in data.decode("utf-8", errors="replace").split("\n") if line.strip()]
    expected = [o["text"] for o in objects if isinstance(o, dict) and isinstance(o.get("text"), str) and o["text"].strip()]
    assert all(o is None or isinstance(o, dict) for o in objects)  # a later `null` line is an empty row
    assert list(ds["text"]) == expected


@CORPUS_SETTINGS
@given(data=st.binary(max_size=300), name=st.sampled_from(["docs.jsonl", "docs.txt", "docs.json"]))
def test_any_bytes_are_documents_or_a_clear_error(tmp_path_factory, data, name):
    try:
        ds = load(tmp_path_factory, name, data)
    except (ValueError, FileNotFoundError):
        return
    assert all(isinstance(t, str) and t.strip() for t in ds["text"])


@CORPUS_SETTINGS
@given(lines=st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Zl", "Zp", "Cs")), max_size=30),
                      max_size=6))
def test_any_text_lines_are_one_document_each(tmp_path_factory, lines):
    try:
        ds = load(tmp_path_factory, "docs.txt", "\n".join(lines).encode())
    except ValueError as err:
        assert "no non-empty documents" in str(err) or "is empty" in str(err), err
        assert not any(line.strip() for line in lines)
        return
    assert list(ds["text"]) == [line for line in lines if line.strip()]


@pytest.mark.parametrize("override", ["model.hidden_size=: [", "run.rounds=!!python/object:os.system ls", "a.b={"])
def test_unparsable_override_values_are_clear_errors(override):
    with pytest.raises(ValueError):
        load_config(None, [override])
