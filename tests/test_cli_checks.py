"""The command line checks a config before it loads or writes anything, and a run's own config is the
default (issue 37, items 3 and 4): a mistyped key, an `outer.fragments` beyond the grid or an empty config
file is refused (exit 2) naming where the key came from and the nearest valid key, with neither torch nor
transformers imported and no file written; `dipaco train --run R` on a finished run trains nothing and
changes no file; `--version`, `make help` with descriptions, lm-eval model options refused by name."""

import hashlib
import logging
import re
import shutil
import subprocess
import sys

import pytest
from cli_helpers import ENV, ROOT, TINY, dipaco_in_process

from dipaco.config import load_config
from dipaco.pipeline.changes import config_changes


def dipaco_importtime(*args) -> subprocess.CompletedProcess:
    """`python -X importtime -m dipaco <args>`: stderr holds one `import time:` line per module imported."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "dipaco", *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)


def imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def messages(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


@pytest.mark.parametrize("override, expected", [
    ("outer.fragmnts=3", "unknown key outer.fragmnts in the command line (outer.fragmnts=3); did you mean outer.fragments?"),
    ("outer.fragments=99", "outer.fragments 99 must be between 1 and the grid's 5 modules"),
])
def test_a_bad_key_is_refused_before_torch_loads_or_a_file_is_written(override, expected, tmp_path):
    run = tmp_path / "run"
    result = dipaco_importtime("train", "--config", TINY, "--run", run, override)
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in messages(result.stderr) and "Traceback" not in result.stderr
    assert not {"torch", "transformers"} & imported(result.stderr)
    assert not run.exists() and list(tmp_path.iterdir()) == []


def test_the_grid_has_the_modules_the_fragments_message_counts():
    """The 5 of the message above, from the topology itself: tiny's levels [1, 2] and its shared embeddings."""
    from dipaco.model.topology import Topology

    config = load_config(TINY)
    assert len(Topology.from_config(config.topology, n_layers=config.model.n_layers).modules) == 5


def test_a_key_mistyped_in_the_file_is_blamed_on_the_file(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(TINY.read_text() + "\ninner:\n  stepz: 3\n")
    code, log = dipaco_in_process("route", "--config", config, "--run", tmp_path / "run")
    assert code == 2 and f"unknown key inner.stepz in {config}; did you mean inner.steps?" in log
    assert not (tmp_path / "run").exists()


def test_an_empty_config_file_is_an_error(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    result = dipaco_importtime("train", "--config", empty, "--run", tmp_path / "run")
    assert result.returncode == 2 and f"config file {empty} holds no settings" in result.stderr
    assert not {"torch", "transformers"} & imported(result.stderr) and not (tmp_path / "run").exists()


def test_version():
    expected = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    result = subprocess.run([sys.executable, "-m", "dipaco", "--version"], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"dipaco {expected}"


def test_help_loads_neither_torch_nor_transformers():
    result = dipaco_importtime("train", "--help")
    assert result.returncode == 0 and "the run's own config.yaml" in result.stdout
    assert not {"torch", "transformers"} & imported(result.stderr)


def snapshot(root) -> dict[str, tuple[int, str]]:
    """Every file under `root`: its mtime (ns) and sha256."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_train_on_a_finished_run_without_config_trains_nothing_and_changes_nothing(tiny_trained, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(tiny_trained.root, run)
    before = snapshot(run)
    caplog.set_level(logging.INFO)
    code, log = dipaco_in_process("train", "--run", run)
    assert code == 0, log
    assert "nothing to train" in caplog.text and "differs" not in caplog.text and "--restart-from" not in caplog.text
    assert snapshot(run) == before


def test_a_longer_run_says_how_many_steps_it_will_train(tiny_trained):
    """inner.steps doubled on the finished run: said as the steps per path planned, trained and to train."""
    old = load_config(tiny_trained.config)
    new = load_config(tiny_trained.config, [f"inner.steps={2 * old.inner.steps}", "eval.batch_size=3"])
    trained = old.run.rounds * old.inner.steps  # the run trained as planned
    lines = config_changes(old, new, run=tiny_trained)
    assert any(f"trains {2 * trained - trained} more per path" in line for line in lines), lines
    assert any(line.startswith("eval.batch_size: ") and "used by this command" in line for line in lines), lines
    assert config_changes(old, old, run=tiny_trained) == []
    seq = load_config(tiny_trained.config, [f"sharding.seq_len={old.sharding.seq_len * 2}"])
    (line,) = config_changes(old, seq, run=tiny_trained)
    assert "shards/ were made with the old value" in line and "--restart-from" not in line


def test_make_help_prints_each_target_with_its_description():
    makefile = (ROOT / "Makefile").read_text()
    described = dict(re.findall(r"^([a-z][\w-]*):[^\n#]*## (.+)$", makefile, flags=re.M))
    result = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and len(described) >= 20
    for target, description in described.items():
        assert re.search(rf"^\s*{re.escape(target)}\s+{re.escape(description.strip())}\s*$", result.stdout, re.M), target


def test_lm_eval_refuses_an_unknown_model_option(tmp_path):
    pytest.importorskip("lm_eval")
    from dipaco.inference.harness import MixtureLM

    with pytest.raises(ValueError, match=r"unknown option rout='likelihood' in --model_args; did you mean route\?"):
        MixtureLM.create_from_arg_string(f"path={tmp_path},rout=likelihood",
                                         {"batch_size": 4, "max_batch_size": None, "device": None})


def test_a_log_line_does_not_print_over_a_progress_bar():
    """What a terminal shows of each line is what follows its last carriage return: the log line alone."""
    import io

    from tqdm import tqdm

    from dipaco.cli import TqdmHandler

    stream = io.StringIO()
    handler = TqdmHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    with tqdm(total=10, file=stream, desc="results applied", mininterval=0) as bar:
        bar.update(3)
        handler.emit(logging.LogRecord("dipaco", logging.INFO, __file__, 1, "round 1: mean train loss 4.2", None, None))
        bar.update(3)
    lines = [line.split("\r")[-1] for line in stream.getvalue().split("\n")]
    assert "round 1: mean train loss 4.2" in lines, stream.getvalue()
    assert any(line.startswith("results applied") for line in lines)  # the bar, drawn again on a line of its own
