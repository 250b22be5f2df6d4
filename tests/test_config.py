"""Config loading: YAML sections, `section.key=value` overrides, and errors that name key and file."""

from pathlib import Path

import pytest

from dipaco.config import Config, load_config, save_config

CONFIGS = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))


def test_defaults_are_valid():
    assert isinstance(load_config(), Config)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


def test_overrides_are_coerced_to_the_field_type(tmp_path):
    cfg = load_config(None, ["inner.steps=7", "outer.lr=1", "topology.levels=[4,4]", "hardware.precision=fp32",
                             "topology.private_embeddings=true", "model.n_layers=8"])
    assert cfg.inner.steps == 7
    assert cfg.outer.lr == 1.0 and isinstance(cfg.outer.lr, float)
    assert cfg.topology.levels == [4, 4]
    assert cfg.topology.private_embeddings is True


def test_exponent_floats_in_yaml_and_overrides_are_floats(tmp_path):
    """YAML 1.1 reads `1e-3` (no dot) as a string; it was refused as "must be float" (issue 29)."""
    path = tmp_path / "lr.yaml"
    path.write_text("inner:\n  lr: 1e-3\nouter:\n  lr: 5E-1\n")
    cfg = load_config(path, ["inner.weight_decay=2e-2"])
    assert (cfg.inner.lr, cfg.outer.lr, cfg.inner.weight_decay) == (0.001, 0.5, 0.02)


def test_unknown_key_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("inner:\n  stepz: 3\n")
    with pytest.raises(ValueError, match=r"inner\.stepz.*bad\.yaml"):
        load_config(path)


def test_unknown_section_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("innr:\n  steps: 3\n")
    with pytest.raises(ValueError, match="innr"):
        load_config(path)


def test_wrong_type_names_key_and_value(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("inner:\n  steps: many\n")
    with pytest.raises(ValueError, match=r"inner\.steps.*bad\.yaml.*'many'"):
        load_config(path)


def test_bad_value_is_reported_with_the_value():
    with pytest.raises(ValueError, match="0.0"):
        load_config(None, ["outer.lr=0"])
    with pytest.raises(ValueError, match="tpu"):
        load_config(None, ["hardware.device=tpu"])


def test_cross_section_check_names_both_values():
    with pytest.raises(ValueError, match=r"\[1, 1\].*n_layers is 4"):
        load_config(None, ["topology.blocks_per_level=[1,1]", "model.n_layers=4"])


def test_malformed_override():
    with pytest.raises(ValueError, match="section.key=value"):
        load_config(None, ["steps=3"])


def test_saved_config_loads_back_the_same_and_leaves_no_temporary_file(tmp_path):
    cfg = load_config(None, ["inner.steps=7", "topology.levels=[4,4]", "eval.modes=[prefix,every:16]"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    save_config(cfg, tmp_path / "run" / "config.yaml")  # over an existing file
    assert load_config(tmp_path / "run" / "config.yaml") == cfg
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["config.yaml"]
