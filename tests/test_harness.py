"""The `dipaco` model type of lm-evaluation-harness (`dipaco.inference.harness`): a shipped local task
(dipaco/data/lm_eval) run offline through `lm_eval.simple_evaluate`, each continuation's log-likelihood
equal to the project's scorer (`token_losses`, one sequence at a time) under the path its context routes
to; rolling log-likelihood and generation against the same references; a dense baseline side by side.

The mixture is conftest's `tiny_mixture` (the tiny run exported with its baselines)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import dipaco
from dipaco.eval.scoring import token_losses
from dipaco.inference.harness import MixtureLM

TASKS = Path(__file__).resolve().parent.parent / "dipaco" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def exported(tiny_mixture) -> Path:
    return tiny_mixture  # read only


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    return TaskManager(include_path=str(TASKS), include_defaults=False)  # the shipped tasks alone: fast


def scorer_loglikelihood(model: torch.nn.Module, context: list[int], continuation: list[int], limit: int) -> float:
    """The continuation's log-likelihood by `token_losses` on the last `limit` tokens, alone in its batch."""
    sequence = np.asarray(context + continuation, dtype=np.int64)[-limit:]
    (losses,) = token_losses(model, [sequence], batch_size=1, device=torch.device("cpu"), precision="fp32")
    return -float(losses[-len(continuation):].sum())


def split(mixture, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Tokens of the context and of the continuation, as lm-evaluation-harness's causal models split them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = (mixture.encode([t])[0].tolist() for t in (context + continuation, context))
    return head, whole[len(head):]


@pytest.mark.parametrize("route", ["router", "likelihood"])
def test_a_local_tasks_loglikelihoods_equal_the_projects_scorer(exported, task_manager, route):
    lm = MixtureLM(path=str(exported), route=route, batch_size=4)
    results = simple_evaluate(model=lm, tasks=["dipaco_demo_continuation"], task_manager=task_manager,
                              log_samples=True, limit=8)
    samples = results["samples"]["dipaco_demo_continuation"]
    assert len(samples) == 8 and 0 <= results["results"]["dipaco_demo_continuation"]["acc,none"] <= 1
    mixture = dipaco.load(exported, route=route)
    paths = set()
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            head, tail = split(mixture, context, continuation)
            (path,) = mixture.route_tokens([np.asarray(head)])
            expected = scorer_loglikelihood(mixture.model(int(path)), head, tail, mixture.max_length)
            assert float(response[0][0]) == pytest.approx(expected, rel=1e-5, abs=1e-5)
            paths.add(int(path))
    assert len(paths) > 1, "every context went to one path: routing per request would go unchecked"


def test_rolling_loglikelihood_and_generation_follow_the_routed_path(exported):
    lm = MixtureLM(path=str(exported))
    mixture = lm.mixture
    texts = ["In the beginning God created the heaven and the earth.", "def main(argv):\n    return 0"]
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    for text, value in zip(texts, lm.loglikelihood_rolling(requests), strict=True):
        (tokens,) = mixture.encode([text])
        assert len(tokens) < mixture.max_length - 1  # one window: after EOS, every token scored once
        (path,) = mixture.route_tokens([tokens])
        expected = scorer_loglikelihood(mixture.model(int(path)), [lm.eot_token_id], tokens.tolist(), mixture.max_length)
        assert value == pytest.approx(expected, rel=1e-5)
    long_text = " ".join(texts * 12)  # several of the harness's rolling windows
    (tokens,) = mixture.encode([long_text])
    (path,) = mixture.route_tokens([tokens])
    windows = list(map(make_disjoint_window, get_rolling_token_windows(
        tokens.tolist(), prefix_token=lm.eot_token_id, max_seq_len=mixture.max_length - 1, context_len=1)))
    assert len(windows) > 2 and sum(len(p) for _, p in windows) == len(tokens)  # each token scored once
    expected = sum(scorer_loglikelihood(mixture.model(int(path)), c, p, mixture.max_length) for c, p in windows)
    (value,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long_text,), 0)])
    assert value == pytest.approx(expected, rel=1e-5)
    prompt = "And God said, Let there be"
    (generated,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 10}), 0)])
    assert generated == mixture.complete(prompt, max_new_tokens=10).continuation.split("\n")[0]


def test_a_dense_baseline_runs_side_by_side_on_the_same_task(exported, task_manager):
    baseline = MixtureLM(path=str(exported / "baselines" / "dense-equal-steps"))
    results = simple_evaluate(model=baseline, tasks=["dipaco_demo_text"], task_manager=task_manager, limit=3)
    perplexity = results["results"]["dipaco_demo_text"]["word_perplexity,none"]
    assert np.isfinite(perplexity) and perplexity > 1
    with pytest.raises(ValueError, match="is one model, not a mixture"):
        MixtureLM(path=str(exported / "baselines" / "dense-equal-steps"), route="likelihood")


def test_side_by_side_puts_the_mixture_and_each_baseline_in_one_table(exported, tmp_path, capsys):
    from dipaco.inference.side_by_side import main as side_by_side

    side_by_side([str(exported), "--tasks", "dipaco_demo_continuation", "--limit", "2", "--json",
                  str(tmp_path / "results.json")])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["model", "dipaco_demo_continuation", "acc"]
    assert [line.split()[0] for line in table[2:]] == ["DiPaCo", "dense-equal-compute", "dense-equal-steps"]
    assert (tmp_path / "results.json").is_file()


@pytest.mark.slow
def test_lm_evals_own_command_line_runs_the_dipaco_model(exported, tmp_path):
    """`python -m dipaco.inference.harness` is lm_eval's command line with `dipaco` registered."""
    import json
    import subprocess
    import sys

    from cli_helpers import ENV

    command = [sys.executable, "-m", "dipaco.inference.harness", "--model", "dipaco", "--model_args",
               f"path={exported},route=likelihood", "--tasks", "dipaco_demo_continuation", "--include_path",
               str(TASKS), "--limit", "2", "--output_path", str(tmp_path / "out")]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (written,) = (tmp_path / "out").rglob("results_*.json")
    assert "acc,none" in json.loads(written.read_text())["results"]["dipaco_demo_continuation"]
