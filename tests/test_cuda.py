"""The GPU check (bench/gpu_check.py) and the tests that need CUDA.

    python -m pytest -q tests/test_cuda.py     # on the CPU: the script's smoke tests; CUDA tests deselected
    python -m pytest -q -m cuda                # only the CUDA tests (the slow ones included), on a GPU machine

Tests marked `cuda` are deselected where torch sees no CUDA device (tests/conftest.py says so in the
summary); selected by `-m cuda` there, they skip with the reason. The fast CPU tests run the script in
process with `dipaco run` faked at the subprocess edge (it writes the eval.json a run would); the
slow one runs every smoke step for real.
"""

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gpu_check, recording  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402

NO_CUDA = (f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}) reports "
           f"torch.cuda.is_available() == False")


def needs_cuda(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)(test))


@pytest.fixture
def results(tmp_path, monkeypatch) -> Path:
    """bench/results/ redirected to a temporary directory."""
    monkeypatch.setattr(recording, "RESULTS", tmp_path / "results")
    return tmp_path / "results"


def fake_dipaco_run(perplexity: float, commands: list[list[str]]):
    """Stands in for gpu_check.run_command: records the command and writes the eval.json and train.json
    that `dipaco run` would, with `perplexity` for every model and path."""

    def run_command(cmd: list[str], *, log_file: Path, timeout: float) -> None:
        commands.append(cmd)
        run = RunDir(cmd[cmd.index("--run") + 1])
        run.eval_results.write_text(json.dumps({
            "models": [{"model": "DiPaCo 2x2 routed", "perplexity": perplexity}],
            "per_path": [{"path": 0, "documents": 3, "perplexity": perplexity}]}))
        run.train_summary.write_text(json.dumps({"rounds": [{"train_loss": {"0": 6.2}}, {"train_loss": {"0": 6.0}}]}))

    return run_command


def smoke(tmp_path: Path, checks: str) -> list[str]:
    return ["--smoke", "--only", checks, "--work", str(tmp_path / "work")]


def test_without_cuda_it_says_so_and_exits_2(monkeypatch, capsys, results):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--smoke" in err
    assert not results.exists()


def test_smoke_runs_the_checks_on_the_cpu_and_writes_one_table(tmp_path, monkeypatch, capsys, results):
    commands = []
    monkeypatch.setattr(gpu_check, "run_command", fake_dipaco_run(123.4, commands))
    assert gpu_check.main(smoke(tmp_path, "torch,pipeline,compile")) == 0  # speed: its own test below

    record = json.loads((results / "gpu_check_smoke.json").read_text())
    checks = {c["check"]: c for c in record["checks"]}
    assert list(checks) == ["torch", "pipeline", "compile"]
    assert record["passed"] and record["smoke"] and record["device"] == "cpu"
    assert checks["torch"]["result"] == "ok" and torch.__version__ in checks["torch"]["detail"]
    assert checks["pipeline"]["result"] == "ok" and "123.40" in checks["pipeline"]["detail"]
    precision, _ = gpu_check.precision_setting("cpu")
    pipeline = commands[0]
    assert pipeline[pipeline.index("--config") + 1] == str(gpu_check.TINY)
    for override in ["hardware.device=cpu", f"hardware.precision={precision}", *gpu_check.SMOKE_PIPELINE]:
        assert override in pipeline
    assert {c["result"] for c in checks.values()} <= {"ok", "skip"}
    out = capsys.readouterr().out
    header = [line for line in out.splitlines() if line.split()[:4] == ["check", "result", "seconds", "detail"]]
    assert len(header) == 1 and any(line.split()[:2] == ["pipeline", "ok"] for line in out.splitlines())
    assert "Source: " in (results / "gpu_check_smoke.md").read_text()


def test_a_non_finite_perplexity_fails_its_check_and_the_exit_status(tmp_path, monkeypatch, results):
    monkeypatch.setattr(gpu_check, "run_command", fake_dipaco_run(math.nan, []))
    assert gpu_check.main(smoke(tmp_path, "pipeline,torch")) == 1
    record = json.loads((results / "gpu_check_smoke.json").read_text())
    pipeline, report = record["checks"]
    assert pipeline["result"] == "FAIL" and "not finite" in pipeline["detail"]
    assert report["result"] == "ok"  # the checks after a failure still run
    assert not record["passed"]


def test_a_crashing_check_is_a_failure_and_the_others_still_run(tmp_path, monkeypatch, results):
    def crash(cmd, *, log_file, timeout):
        raise OSError("no such file")

    monkeypatch.setattr(gpu_check, "run_command", crash)
    assert gpu_check.main(smoke(tmp_path, "pipeline,torch")) == 1
    pipeline, report = json.loads((results / "gpu_check_smoke.json").read_text())["checks"]
    assert (pipeline["result"], pipeline["detail"]) == ("FAIL", "OSError: no such file")
    assert report["result"] == "ok"


def test_compile_runs_tiny_with_hardware_compile(tmp_path, monkeypatch, results):
    commands = []
    monkeypatch.setattr(gpu_check, "run_command", fake_dipaco_run(50.0, commands))
    assert gpu_check.main(smoke(tmp_path, "compile")) == 0
    (outcome,) = json.loads((results / "gpu_check_smoke.json").read_text())["checks"]
    assert outcome["result"] == "ok" and "hardware.compile=true" in commands[0]
    assert "6.200 -> 6.000" in outcome["detail"]


def test_the_torch_row_names_the_gpu_from_what_torch_reports(monkeypatch):
    """The CUDA branch of the report, with torch's CUDA queries answered as an H100 would."""
    import torch.distributed as dist

    h100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30)
    for module, name, value in [(torch.cuda, "is_available", True), (torch.cuda, "device_count", 2),
                                (torch.cuda, "get_device_properties", h100), (torch.cuda, "is_bf16_supported", True),
                                (torch.cuda.nccl, "version", (2, 21, 5)), (dist, "is_nccl_available", True),
                                (torch.backends.cudnn, "version", 90100)]:
        monkeypatch.setattr(module, name, lambda *args, value=value: value)
    report = gpu_check.torch_report()
    assert report["gpus"] == 2 and report["capability"] == "9.0" and report["nccl"] == "2.21.5"
    assert gpu_check.describe_torch(report).startswith(
        "2 x NVIDIA H100 80GB HBM3 (capability 9.0, 80.0 GiB), bf16 yes, NCCL 2.21.5, torch ")


def test_pseudo_gradient_difference_is_relative_to_the_one_process_result():
    one = {"a/w": torch.ones(3), "b/w": torch.zeros(1)}
    assert gpu_check.pseudo_gradient_difference(one, one) == (0.0, 0.0)
    off = {"a/w": torch.tensor([1.0, 1.0, 1.3]), "b/w": torch.zeros(1)}
    relative, largest = gpu_check.pseudo_gradient_difference(off, one)
    assert relative == pytest.approx(0.3 / math.sqrt(3)) and largest == pytest.approx(0.3)
    with pytest.raises(gpu_check.Failed):
        gpu_check.pseudo_gradient_difference({"a/w": torch.ones(3)}, one)


BENCH_SPEED = {
    "with --device": ("import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--device')\n"
                      "parser.add_argument('--name')\nargs = parser.parse_args()\n"
                      "print(f'inner loop on {args.device}: 1234 tokens/s, results {args.name}')\n"),
    "without --device": "import argparse\nargparse.ArgumentParser().parse_args()\n",
    "absent": None,
}


@pytest.mark.parametrize("script", BENCH_SPEED)
def test_the_speed_benchmark_runs_with_device_cuda_when_it_takes_the_option(tmp_path, monkeypatch, script):
    path = tmp_path / "bench_speed.py"
    if BENCH_SPEED[script] is not None:
        path.write_text(BENCH_SPEED[script])
    monkeypatch.setattr(gpu_check, "SPEED", path)
    outcome = gpu_check.run_check("speed", gpu_check.Plan(smoke=False, work=tmp_path / "work", gpus=1))
    expected = {"with --device": ("ok", "on cuda: 1234 tokens/s, results speed-cuda"), "without --device": ("skip", "takes no --device"),
                "absent": ("skip", "not in this checkout")}[script]
    assert outcome.result == expected[0] and expected[1] in outcome.detail, outcome


@pytest.mark.slow
def test_every_smoke_step_runs_for_real_on_the_cpu(tmp_path, results):
    """The whole --smoke run: tiny pipeline, 2-process gloo island, compile if configured, speed --help."""
    assert gpu_check.main(["--smoke", "--work", str(tmp_path / "work")]) == 0
    checks = {c["check"]: c for c in json.loads((results / "gpu_check_smoke.json").read_text())["checks"]}
    assert checks["pipeline"]["result"] == checks["torchrun"]["result"] == "ok", checks


# --- CUDA ------------------------------------------------------------------------------------------
@needs_cuda
def test_torch_reports_the_gpu_bf16_and_nccl():
    report = gpu_check.torch_report()
    assert report["gpus"] >= 1 and report["device"] and report["capability"]
    assert report["bf16"] == torch.cuda.is_bf16_supported()
    assert report["nccl_available"] and report["nccl"]


@needs_cuda
def test_the_pipeline_precision_auto_resolves_on_the_gpu():
    precision, note = gpu_check.precision_setting("cuda")
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if precision == "auto":
        assert note.endswith(f"-> {expected}"), note
    else:  # a dipaco without precision auto: the script passes what auto would pick
        assert precision == expected


@needs_cuda
def test_a_torchrun_island_on_cuda_gives_the_one_process_pseudo_gradient(tmp_path, results):
    """2 NCCL ranks when 2 GPUs exist, 1 process otherwise (about a minute)."""
    assert gpu_check.main(["--only", "torch,torchrun", "--work", str(tmp_path / "work")]) == 0


@pytest.mark.slow
@needs_cuda
def test_the_whole_gpu_check_passes(tmp_path, results):
    """`make gpu-check` (the demo on CUDA, torchrun, compile, speed): under 10 minutes on one modern GPU."""
    assert gpu_check.main(["--work", str(tmp_path / "work")]) == 0
