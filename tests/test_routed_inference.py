"""End to end on the tiny config: routed eval and eval modes against a direct computation, --best,
export to transformers, generate (replica-aware routing), the report.

The run is conftest's session-wide `tiny_trained`: one `dipaco run` with 3 rounds and one module version
kept, so pruning has to keep the best versions, and every eval mode."""

import json
import logging
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_helpers import ENV

import dipaco
from dipaco.cli import main
from dipaco.config import load_config
from dipaco.eval.early_stopping import best_rounds, read_history
from dipaco.optim.dense import load_dense
from dipaco.pipeline.context import PathFactory
from dipaco.run_dir import RunDir
from dipaco.stages.generate import generate
from routing.router import Router
from sharding.tokenizer import decode_prefix, encode_batch, load_tokenizer


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


def chunk_nll(model, doc: np.ndarray, start: int, end: int) -> float:
    """Summed loss of tokens start..end-1, the model reading only the document's first `end` tokens
    (in fp32: the tiny config evaluates in fp32, so the eval's batched losses match to rounding)."""
    ids = torch.as_tensor(doc[:end], dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")[start - 1 : end - 1].sum())


def reference_routed_nll(run: RunDir, *, window: int) -> tuple[float, int, dict[int, tuple[float, int]], bool]:
    """Routed evaluation computed directly, without dipaco.eval: each test document's tokens after the
    prefix P are cut in chunks [P, P+W), [P+W, P+2W), ...; the router picks a chunk's path from the
    text of the P tokens just before it; that path's model scores the chunk (`chunk_nll`, unbatched).
    Returns (total loss, tokens, {path of the first chunk: (loss, tokens)}, whether some document
    changed path between chunks)."""
    config = load_config(run.config)
    factory = PathFactory(config, run)
    docs, _, _ = factory.reader.test_documents()
    prefix, last = config.routing.prefix_tokens, factory.store.current_round()
    router, tokenizer = Router.load(run.routing), load_tokenizer(run.tokenizer)
    chunks = [(d, s, min(s + window, len(doc))) for d, doc in enumerate(docs) for s in range(prefix, len(doc), window)]
    paths = router.route([decode_prefix(tokenizer, docs[d][s - prefix:s], prefix)  # replicas = 1
                          for d, s, _ in chunks]).tolist()
    models = {p: factory.load_path(path=p, round=last).eval() for p in set(paths)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny forward passes: more threads only contend on a shared machine
    try:
        losses = [chunk_nll(models[p], docs[d], s, e) for (d, s, e), p in zip(chunks, paths)]
    finally:
        torch.set_num_threads(threads)
    per_path, first = {}, {}
    for (d, s, e), p, loss in zip(chunks, paths, losses):
        q = first.setdefault(d, p)
        nll, count = per_path.get(q, (0.0, 0))
        per_path[q] = (nll + loss, count + e - s)
    rerouted = any(p != first[d] for (d, _, _), p in zip(chunks, paths))
    return sum(losses), sum(e - s for _, s, e in chunks), per_path, rerouted


def test_routed_eval_and_every_mode_match_a_direct_computation(run):
    # an fp32 reference checks an fp32 eval; `hardware.precision: auto` would be bf16 on a CPU with
    # AVX512-BF16 (per-token losses off by up to ~7e-3, a path's perplexity by ~1e-4)
    config = load_config(run.config)
    assert config.hardware.precision == "fp32"
    results = json.loads(run.eval_results.read_text())
    rows = {(r["mode"], r["checkpoints"]): r for r in results["modes"]["rows"]}
    assert all(r["tokens"] == results["scored_tokens"] for r in rows.values())
    routed = next(m for m in results["models"] if m["model"].startswith("DiPaCo"))
    nll, tokens, per_path, _ = reference_routed_nll(run, window=10_000)  # prefix: one chunk per document
    assert tokens == results["scored_tokens"]
    for model in results["models"]:  # the baselines score exactly these tokens too (their losses: the test below)
        assert (model["scored_tokens"], model["skipped_prefix_tokens"]) == (tokens, config.routing.prefix_tokens), model
    assert routed["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert rows["prefix", "last"]["perplexity"] == routed["perplexity"]  # the headline is the prefix mode
    for p in results["per_path"]:
        loss, count = per_path.get(p["path"], (0.0, 0))
        assert (p["documents"] > 0) == (count > 0) and p["tokens"] == count
        if count:
            assert p["perplexity"] == pytest.approx(math.exp(loss / count), rel=1e-5)
    # every:16 re-routes the 56 scored tokens of a 64-token document 3 times
    nll, tokens, _, rerouted = reference_routed_nll(run, window=16)
    assert rerouted, "some document should change path between chunks, or every:16 checks nothing more than prefix"
    assert rows["every:16", "last"]["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    # a window of the sequence length (64) or more leaves one chunk: the prefix routing again
    assert rows["every:64", "last"]["perplexity"] == rows["prefix", "last"]["perplexity"]
    for checkpoints in ("last", "best"):
        assert rows["oracle", checkpoints]["perplexity"] <= rows["prefix", checkpoints]["perplexity"]
    grid = np.array(results["modes"]["all_paths"], dtype=float)
    for p in results["per_path"]:
        if p["documents"]:
            assert grid[p["path"], p["path"]] == pytest.approx(p["perplexity"], rel=1e-6)


def test_each_baseline_scores_the_routed_paths_tokens_and_matches_a_direct_computation(run):
    """A dense baseline reads each whole test document and scores the tokens the routed paths score, those
    after the routing prefix (`chunk_nll`, unbatched): the same count and the same perplexity as eval.json."""
    config = load_config(run.config)
    factory = PathFactory(config, run)
    docs, _, _ = factory.reader.test_documents()
    prefix = config.routing.prefix_tokens
    results = json.loads(run.eval_results.read_text())
    baselines = [m for m in results["models"] if m["model"].startswith("dense-")]
    assert {m["model"] for m in baselines} == {"dense-equal-steps", "dense-equal-compute"}
    for row in baselines:
        model, _ = load_dense(run.baselines / row["model"], factory.spec)
        model.eval()
        scored = [(doc, len(doc)) for doc in docs if len(doc) > prefix]
        nll = sum(chunk_nll(model, doc, prefix, end) for doc, end in scored)
        tokens = sum(end - prefix for _, end in scored)
        assert row["scored_tokens"] == tokens == results["scored_tokens"], row
        assert row["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5), row


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
    index = json.loads((tmp_path / "all" / "dipaco_mixture.json").read_text())
    assert len(index["paths"]) == 4 and (tmp_path / "all" / "router" / "router.json").exists()
    weights = json.loads((tmp_path / "all" / "model.safetensors.index.json").read_text())["weight_map"]
    for entry in index["paths"].values():  # each path's modules (at its best version) are in the shards
        assert all(any(name.startswith(f"grid.{stored}.") for name in weights) for stored in entry["modules"].values())
    mixture = dipaco.load(tmp_path / "all")
    assert all(mixture.model(p) is not None for p in mixture.path_ids)
    capsys.readouterr()
    assert main(["generate", "--run", str(run.root), "In the beginning", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    match = re.match(r"\[path (\d) \(\d,\d\), round \d\]\n(.*)", out, re.S)
    assert match and match.group(2).startswith("In the beginning")


def test_generate_says_when_the_sequence_length_caps_max_new_tokens(run, caplog):
    """It capped --max-new-tokens at what sharding.seq_len leaves silently (issue 29)."""
    factory = PathFactory(load_config(run.config), run)
    rounds = {p: factory.store.current_round() for p in range(factory.topology.n_paths)}
    with caplog.at_level(logging.WARNING):
        generate(factory, "In the beginning", rounds=rounds, max_new_tokens=1000)
    assert "--max-new-tokens 1000: a path sees at most sharding.seq_len 64 tokens" in caplog.text


def test_generate_uses_the_first_replica_of_the_routed_path(run):
    """With DiLoCo replicas (here 2 per routed path; they share every module, so this run's store
    serves them) a prompt routed to path q is generated by path 2q, the replica evaluation loads."""
    docs, _, _ = PathFactory(load_config(run.config), run).reader.test_documents()
    config = load_config(run.config, ["topology.replicas=2"])
    factory = PathFactory(config, run)
    router, tokenizer = Router.load(run.routing), load_tokenizer(run.tokenizer)
    prompts = [tokenizer.decode(doc[:12].tolist()) for doc in docs]
    routed = {int(router.route([decode_prefix(tokenizer, ids, config.routing.prefix_tokens)])[0]): prompt
              for prompt, ids in zip(prompts, encode_batch(tokenizer, prompts))}
    assert set(routed) - {0}, "a prompt routed to a path other than 0 tells replica 2q from path q"
    rounds = {p: factory.store.current_round() for p in range(factory.topology.n_paths)}
    for q, prompt in sorted(routed.items()):
        text, path = generate(factory, prompt, rounds=rounds, max_new_tokens=2)
        assert path == 2 * q and text.startswith(prompt[:8])


def test_report_is_written_and_every_image_exists(run):
    report = (run.root / "report.md").read_text()
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report)
    assert {"report/loss.png", "report/perplexity.png", "report/paths.png", "report/bytes.png"} <= set(images)
    for image in images:
        data = (run.root / image).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, image
    assert "Best round per path" in report


def test_generate_by_likelihood_picks_the_path_that_reads_the_prefix_best(run):
    """`--route likelihood`: the path whose model gives the prompt's first prefix_tokens tokens the lowest
    loss (computed here with each model's own forward pass) continues it."""
    config = load_config(run.config)
    factory = PathFactory(config, run)
    docs, _, _ = factory.reader.test_documents()
    tokenizer = factory.tokenizer
    rounds = {p: factory.store.current_round() for p in range(factory.topology.n_paths)}
    prefix = config.routing.prefix_tokens
    for doc in docs[:6]:
        prompt = tokenizer.decode(doc[:prefix].tolist())
        (ids,) = encode_batch(tokenizer, [prompt])
        ids = torch.as_tensor(np.asarray(ids[:prefix]), dtype=torch.long)[None]
        losses = []
        for p in range(factory.topology.n_paths):
            with torch.no_grad():
                logits = factory.load_path(path=p, round=rounds[p])(input_ids=ids).logits[0, :-1]
            losses.append(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")))
        text, path = generate(factory, prompt, rounds=rounds, max_new_tokens=2, route="likelihood")
        assert path == int(np.argmin(losses)) and text.startswith(prompt[:8])
    with pytest.raises(ValueError, match="route must be one of .* or likelihood:K"):
        generate(factory, "In the beginning", rounds=rounds, route="nearest")
