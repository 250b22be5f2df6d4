"""End to end on the tiny config: eval modes, --best, export to transformers, generate, the report.

The run is conftest's session-wide `tiny_trained`: one `dipaco run` with 3 rounds and one module version
kept, so pruning has to keep the best versions, and every eval mode."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_helpers import ENV

from dipaco.cli import main
from dipaco.config import load_config
from dipaco.eval.early_stopping import best_rounds, read_history
from dipaco.run_dir import RunDir
from dipaco.stages.context import PathFactory


@pytest.fixture(scope="module")
def run(tiny_trained) -> RunDir:
    return tiny_trained  # read only


def test_best_is_the_version_with_the_lowest_validation_loss_and_survives_pruning(run):
    config = load_config(run.config)
    factory = PathFactory(config, run)
    history = read_history(factory.store)
    summary = json.loads(run.train_summary.read_text())
    for p in range(factory.topology.n_paths):
        assert sorted(history[p]) == [0, 1, 2, 3]  # every version, the last one included
        for r in summary["rounds"]:  # the islands' val_loss_start is the loss of version round - 1
            assert history[p][r["round"] - 1] == pytest.approx(r["val_loss_start"][str(p)])
    best = best_rounds(history)
    for p, version in best.items():
        assert history[p][version] == min(history[p].values())
        factory.load_path(path=p, round=version)  # its modules were kept
    results = json.loads(run.eval_results.read_text())
    assert {int(p): r for p, r in results["modes"]["best_rounds"].items()} == best


def test_modes_score_the_same_tokens_and_prefix_matches_the_routed_eval(run):
    results = json.loads(run.eval_results.read_text())
    rows = {(r["mode"], r["checkpoints"]): r for r in results["modes"]["rows"]}
    assert all(r["tokens"] == results["scored_tokens"] for r in rows.values())
    routed = next(m for m in results["models"] if m["model"].startswith("DiPaCo"))
    assert rows["prefix", "last"]["perplexity"] == pytest.approx(routed["perplexity"], rel=1e-6)
    assert rows["every:64", "last"]["perplexity"] == rows["prefix", "last"]["perplexity"]  # 64 = seq_len
    for checkpoints in ("last", "best"):
        assert rows["oracle", checkpoints]["perplexity"] <= rows["prefix", checkpoints]["perplexity"]
    grid = np.array(results["modes"]["all_paths"], dtype=float)
    for p in results["per_path"]:
        if p["documents"]:
            assert grid[p["path"], p["path"]] == pytest.approx(p["perplexity"], rel=1e-6)


def test_exported_path_loads_without_dipaco_and_gives_the_same_logits(run, tmp_path):
    out = tmp_path / "path1"
    assert main(["export", str(out), "--run", str(run.root), "--path", "1"]) == 0
    config = load_config(run.config)
    factory = PathFactory(config, run)
    docs, _, _ = factory.reader.test_documents()
    tokens = docs[0][:40]
    np.save(tmp_path / "tokens.npy", tokens)
    script = (
        "import sys, numpy as np, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r}).eval()\n"
        f"tok = AutoTokenizer.from_pretrained({str(out)!r})\n"
        f"ids = torch.as_tensor(np.load({str(tmp_path / 'tokens.npy')!r}))[None]\n"
        "with torch.no_grad():\n"
        "    logits = model(input_ids=ids).logits[0].numpy()\n"
        f"np.save({str(tmp_path / 'logits.npy')!r}, logits)\n"
        "assert not any(m == 'dipaco' or m.startswith(('dipaco.', 'routing', 'sharding')) for m in sys.modules)\n"
        "print(tok.decode(ids[0].tolist())[:20])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() and result.stdout.strip() in factory.tokenizer.decode(tokens.tolist())
    model = factory.load_path(path=1, round=factory.store.current_round()).eval()
    with torch.no_grad():
        expected = model(input_ids=torch.as_tensor(tokens)[None]).logits[0].numpy()
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, rtol=1e-5, atol=1e-5)


def test_export_all_and_generate_name_the_path(run, tmp_path, capsys):
    assert main(["export", str(tmp_path / "all"), "--run", str(run.root), "--all", "--best"]) == 0
    index = json.loads((tmp_path / "all" / "paths.json").read_text())
    assert index["n_paths"] == 4 and (tmp_path / "all" / "router" / "router.json").exists()
    for entry in index["paths"].values():
        assert (tmp_path / "all" / entry["dir"] / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["generate", "--run", str(run.root), "In the beginning", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    match = re.match(r"\[path (\d) \(\d,\d\), round \d\]\n(.*)", out, re.S)
    assert match and match.group(2).startswith("In the beginning")


def test_report_is_written_and_every_image_exists(run):
    report = (run.root / "report.md").read_text()
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report)
    assert {"report/loss.png", "report/perplexity.png", "report/paths.png", "report/bytes.png"} <= set(images)
    for image in images:
        data = (run.root / image).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, image
    assert "Best round per path" in report
