"""bench/bench_quality.py's DiLoCo is DiPaCo's path model, data and budget with P replicas (no training here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_quality import as_override, diloco_overrides
from bench.quality_runs import pretrain_key, routing_key
from dipaco.config import load_config
from dipaco.store.records import OuterStep, RoundManifest, RoundStats

ROOT = Path(__file__).resolve().parent.parent
DEMO, DILOCO = ROOT / "configs" / "demo.yaml", ROOT / "configs" / "diloco.yaml"
RECIPE = ["model.hidden_size=64", "sharding.seq_len=128", f"warm_start.fraction={50 / (50 + 8 * 3 * 10)!r}", "run.rounds=3",
          "topology.levels=[2,4]", "outer.lr=0.9", "outer.momentum=0.5", "outer.rescale_by_paths=true",
          "routing.featurizer=base-model", "corpus.max_documents=500"]


def test_an_override_reads_back_as_its_value():
    cases = [("corpus", "path", "demo"), ("routing", "hf_model", ""), ("inner", "steps", 3), ("inner", "lr", 2.5e-3),
             ("warm_start", "init_modules", False), ("topology", "levels", [2, 2]), ("topology", "private_blocks", [])]
    config = load_config(None, [as_override(*case) for case in cases])
    for section, key, value in cases:
        assert getattr(getattr(config, section), key) == value, (section, key)


def test_diloco_trains_dipacos_path_model_on_the_same_data_and_budget():
    dipaco = load_config(DEMO, RECIPE)
    diloco = load_config(DILOCO, diloco_overrides(dipaco, outer=False))
    for section in ("corpus", "sharding", "model", "inner", "warm_start", "hardware"):
        assert getattr(diloco, section) == getattr(dipaco, section), section
    assert diloco.run.rounds == 3 and diloco.routing.prefix_tokens == dipaco.routing.prefix_tokens
    assert diloco.topology.levels == [1] and diloco.topology.replicas == 8  # one path, P = 2 x 4 replicas
    assert not diloco.outer.rescale_by_paths and diloco.outer.lr != 0.9  # its own outer step
    same_outer = load_config(DILOCO, diloco_overrides(dipaco, outer=True))
    assert same_outer.outer == dipaco.outer
    # the same warm start, so the bench copies DiPaCo's pretrained model instead of training another
    assert pretrain_key(diloco) == pretrain_key(dipaco)
    assert routing_key(diloco) != routing_key(dipaco)


def eval_json(*, routed: float, oracle: float, steps: float, compute: float) -> dict:
    """A small eval.json of a 2x2 DiPaCo run with both dense baselines (the perplexities given)."""
    def row(model, perplexity, *, paths=1, steps=10):
        return {"model": model, "paths": paths, "params_per_path": 1000, "params_total": 1000 * paths,
                "pretrain_steps": 5, "steps_per_path": steps, "steps_total": 5 + steps, "tokens_seen": 640 * steps,
                "train_tokens_total": 640 * (5 + steps), "train_seconds": 1.0, "perplexity": perplexity}

    return {"models": [row("DiPaCo 2x2 routed", routed, paths=4), row("dense-equal-steps", steps),
                       row("dense-equal-compute", compute, steps=40)],
            "scored_tokens": 560, "test_documents": 10, "routing_agrees_with_shards": 0.9,
            "per_path": [{"path": p, "label": f"({p // 2},{p % 2})", "documents": 2 + p, "tokens": 56 * (2 + p),
                          "perplexity": routed + p} for p in range(4)],
            "modes": {"rows": [{"mode": "prefix", "checkpoints": "last", "perplexity": routed},
                               {"mode": "oracle", "checkpoints": "last", "perplexity": oracle}], "all_paths": None}}


def test_a_run_without_diloco_says_so_and_a_run_with_it_reports_the_gap(tmp_path):
    """`--no-diloco`: the results collected from a DiPaCo run's eval.json alone (written here) and their table."""
    from bench.bench_quality import compare, markdown
    from bench.quality_runs import Runner

    (tmp_path / "dipaco").mkdir()
    (tmp_path / "dipaco" / "eval.json").write_text(json.dumps(eval_json(routed=120.0, oracle=100.0, steps=150.0,
                                                                        compute=80.0)))
    # `--no-diloco --collect-only`: reads the runs under the root, trains nothing
    results = compare(Runner(tmp_path, keep=True), DEMO, RECIPE, diloco=False, collect_only=True)
    results.update(budget=1.0, seconds=60.0)
    assert results["checks"]["dipaco_vs_diloco"] is None and results["checks"]["dipaco_vs_diloco_same_outer"] is None
    assert results["checks"]["dipaco_over_dense_equal_compute"] == pytest.approx(120 / 80)
    assert results["checks"]["dipaco_vs_dense_equal_steps"] == pytest.approx(1 - 120 / 150)
    assert results["checks"]["routed_over_oracle"] == pytest.approx(120 / 100 - 1)
    assert "DiPaCo against DiLoCo with its own outer step: not run" in markdown(results)
    results["checks"]["dipaco_vs_diloco"] = 0.1
    text = markdown(results)
    assert "own outer step: 10.0% lower perplexity" in text and "DiPaCo against DiLoCo: not run" in text


def train_json(name: str, step: OuterStep, rounds: int = 3) -> dict:
    """train.json of a run whose `rounds` rounds all took `step` (named `name`), trained at a clean commit."""
    rows = [RoundStats.of(RoundManifest(round=r, applied=(), dropped=(), outer=step), in_flight=0, outer_step=name)
            for r in range(1, rounds + 1)]
    return {"rounds": [r.to_json() for r in rows], "code": [{"commit": "c" * 40, "clean": True, "first_round": 1}]}


def test_the_headline_is_dipaco_against_diloco_s_best_outer_step_as_applied(tmp_path):
    """Both DiLoCo runs collected (written here): the headline takes the better one, the header says each
    run's outer steps from its train.json rows (not the config), and the runs' training code is collected."""
    from bench.bench_quality import compare, markdown
    from bench.quality_runs import Runner

    nesterov = OuterStep(lr=0.7, momentum=0.9, nesterov=True, rescale_by_paths=False)
    average = OuterStep(lr=1.0, momentum=0.0, nesterov=False, rescale_by_paths=False)
    dipaco_eval = eval_json(routed=90.0, oracle=85.0, steps=150.0, compute=80.0)
    for name, perplexity, step, kind in (("dipaco", None, average, "average"), ("diloco", 110.0, nesterov, "configured"),
                                         ("diloco-dipaco-outer", 100.0, average, "average")):
        (tmp_path / name).mkdir()
        ev = dipaco_eval if perplexity is None else {**dipaco_eval, "models": [{**dipaco_eval["models"][0],
                                                                                  "perplexity": perplexity}]}
        (tmp_path / name / "eval.json").write_text(json.dumps(ev))
        (tmp_path / name / "train.json").write_text(json.dumps(train_json(kind, step)))
    results = compare(Runner(tmp_path, keep=True), DEMO, RECIPE, collect_only=True)
    assert results["checks"]["dipaco_vs_best_diloco"] == pytest.approx(1 - 90 / 100)
    assert results["best_diloco"].startswith("DiLoCo, DiPaCo's outer step")
    assert [t["what"] for t in results.pop("trained_at")] == [f"{n}: rounds from 1" for n in
                                                              ("dipaco", "diloco", "diloco-dipaco-outer")]
    results.update(budget=1.0, seconds=60.0)
    text = markdown(results)
    assert "against DiLoCo under its best outer step (DiLoCo, DiPaCo's outer step (4 replicas)): 10.0% lower" in text
    assert ("DiPaCo: rounds 1-3: plain average (lr 1, momentum 0) in the inner lr's decay; DiLoCo, its own outer "
            "step: rounds 1-3: Nesterov SGD lr 0.7, momentum 0.9; DiLoCo, DiPaCo's outer step: rounds 1-3: plain "
            "average") in text


def test_diloco_only_trains_the_diloco_runs_and_nothing_else(tmp_path):
    """`--diloco-only` (DiLoCo on one core while another invocation trains DiPaCo): only the DiLoCo
    pipelines run, and no results are collected from a DiPaCo run that may not have finished."""
    from bench.bench_quality import compare

    class Recorder:
        root = tmp_path
        names: list[str] = []

        def pipeline(self, name, *_, **__):
            self.names.append(name)
            return tmp_path / name

    runner = Recorder()
    assert compare(runner, DEMO, RECIPE, diloco_only=True) is None
    assert runner.names == ["diloco", "diloco-dipaco-outer"]
    runner.names.clear()
    assert compare(runner, DEMO, RECIPE, diloco_only=True, diloco_dipaco_outer=False) is None
    assert runner.names == ["diloco"]


def fake_stages(monkeypatch, calls: list[str], rounds: int):
    """`bench.quality_runs.dipaco` replaced by a recorder that writes what each stage would."""
    import bench.quality_runs as quality_runs

    def stage(*args, log_file=None):
        command, run = args[0], Path(args[args.index("--run") + 1])
        stop = next((int(a.split("=")[1]) for a in args if a.startswith("run.stop_after_round=")), rounds)
        calls.append(command if command != "train" or stop == rounds else f"train to {stop}")
        if command == "pretrain":
            (run / "pretrain").mkdir(parents=True, exist_ok=True)
            (run / "pretrain" / "summary.json").write_text("{}")
        elif command == "route":
            (run / "routing").mkdir(parents=True, exist_ok=True)
            (run / "routing" / "assignments.json").write_text("{}")
        elif command == "shard":
            (run / "shards").mkdir(parents=True, exist_ok=True)
            (run / "shards" / "index.json").write_text("{}")
        elif command == "train":
            (run / "train.json").write_text(json.dumps({"rounds": [{}] * stop}))
        elif command == "reroute":
            phases = run / "routing" / "phases.json"
            done = json.loads(phases.read_text()) if phases.exists() else []
            after = len(json.loads((run / "train.json").read_text())["rounds"])
            phases.write_text(json.dumps([*done, {"after_round": after}]))
        elif command == "eval":
            (run / "eval.json").write_text(json.dumps({"router_phases": len(quality_runs.rerouted_after(run))}))

    monkeypatch.setattr(quality_runs, "dipaco", stage)


def test_reroute_phases_run_midway_and_before_evaluation_in_order(tmp_path, monkeypatch):
    """`--reroute-after 5,10` of a 10-round run: the baselines train on the first shards, training stops
    after version 5 for a phase and goes on; the last phase re-fits the router after evaluation by the
    previous one (kept as eval-before-reroute.json), and evaluation runs again by the new router."""
    from bench.quality_runs import Runner

    calls: list[str] = []
    fake_stages(monkeypatch, calls, rounds=10)
    overrides = ["corpus.router_fraction=0.05", "run.rounds=10", "warm_start.fraction=0.01"]
    run = Runner(tmp_path).pipeline("dipaco", DEMO, overrides, baselines=True, modes=["prefix"], reroute_after=(5, 10))
    assert calls == ["pretrain", "route", "shard", "baselines", "train to 5", "reroute", "train", "eval", "reroute",
                     "eval"]
    assert json.loads((run / "eval-before-reroute.json").read_text()) == {"router_phases": 1}
    assert json.loads((run / "eval.json").read_text()) == {"router_phases": 2}
    calls.clear()  # a second invocation (--keep) redoes nothing but the baselines' own check
    Runner(tmp_path, keep=True).pipeline("dipaco", DEMO, overrides, baselines=True, modes=["prefix"],
                                         reroute_after=(5, 10))
    assert calls == ["baselines"]


def test_reroute_phases_need_a_router_split_and_versions_of_the_run(tmp_path, monkeypatch):
    from bench.quality_runs import Runner

    fake_stages(monkeypatch, [], rounds=10)
    runner = Runner(tmp_path)
    with pytest.raises(ValueError, match="router_fraction"):
        runner.pipeline("a", DEMO, ["run.rounds=10"], baselines=False, modes=["prefix"], reroute_after=(5,))
    with pytest.raises(ValueError, match=r"\(11,\).*\[1, 10\]"):
        runner.pipeline("b", DEMO, ["run.rounds=10", "corpus.router_fraction=0.05"], baselines=False,
                        modes=["prefix"], reroute_after=(11,))
