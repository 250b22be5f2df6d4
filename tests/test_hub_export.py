"""The exported mixture as a Hugging Face repository (`dipaco export DIR`, `dipaco.inference.hub_repo`):
transformers alone, in a process where dipaco cannot be imported, loads it with `trust_remote_code` and
generates what `dipaco.load` generates for both routings; the tokenizer round-trips at the top level; the
model card parses as hub metadata with eval.json's perplexities; a 2x2 export stores each module once
across its shards; files and directories get normal permissions.

The mixture is conftest's `tiny_mixture` (the tiny run exported by the CLI, then moved)."""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest
from safetensors import safe_open

import dipaco
from dipaco.config import load_config
from dipaco.inference.hub_repo import INDEX
from dipaco.pipeline.context import PathFactory
from dipaco.stages.export import export_mixture

# transformers alone: isolated (-I: no PYTHONPATH, no user site, no script directory) and without site (-S:
# no .pth file, so not the editable install's finder); only the interpreter's site-packages on the path
ALONE = textwrap.dedent("""
    import json, sys
    sys.path.append(SITE)
    for name in ("dipaco", "routing", "sharding"):
        try:
            __import__(name)
        except ModuleNotFoundError:
            continue
        raise SystemExit(f"{name} imports here: the test would not show that transformers alone loads the export")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(EXPORT, trust_remote_code=True)
    out = {"max_length": tok.model_max_length, "roundtrip": []}
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=False).input_ids
        out["roundtrip"].append([ids, tok.decode(ids)])
    for route in ("router", "likelihood"):
        model = AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True, route=route)
        rows = []
        for text in PROMPTS:
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            new = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
            rows.append([model.last_paths[0], new.tolist()])
        out[route] = rows
    print("RESULT", json.dumps(out))
""")


@pytest.fixture(scope="module")
def factory(tiny_trained) -> PathFactory:
    return PathFactory(load_config(tiny_trained.config), tiny_trained)


@pytest.fixture(scope="module")
def prompts(factory) -> list[str]:
    """Prompts from test documents' first tokens, so the router spreads them over several paths."""
    docs, _, _ = factory.reader.test_documents()
    return [factory.tokenizer.decode(doc[:12].tolist()) for doc in docs[:6]]


@pytest.fixture(scope="module")
def alone(tiny_mixture, prompts, tmp_path_factory) -> dict:  # 10-30 s: a fresh interpreter imports torch
    """What transformers alone makes of the export, in a process where dipaco cannot be imported."""
    script = f"SITE = {sysconfig.get_paths()['purelib']!r}\nEXPORT = {str(tiny_mixture)!r}\nPROMPTS = {prompts!r}\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", "-S", "-c", script + ALONE], capture_output=True, text=True,
                          cwd=tmp_path_factory.mktemp("elsewhere"), env=env, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
@pytest.mark.parametrize("route", ["router", "likelihood"])
def test_transformers_alone_generates_what_dipaco_load_generates(alone, tiny_mixture, prompts, route):
    mixture = dipaco.load(tiny_mixture, route=route)
    expected = []
    for prompt in prompts:
        completion = mixture.complete(prompt, max_new_tokens=8)
        expected.append([completion.path, completion.tokens.tolist()])
    assert alone[route] == expected
    if route == "router":
        assert len({path for path, _ in expected}) > 1, "every prompt went to one path: routing is not tested"


@pytest.mark.slow
def test_the_tokenizer_round_trips_at_the_top_level(alone, tiny_mixture, factory, prompts):
    assert alone["max_length"] == factory.config.sharding.seq_len
    for (ids, text), prompt in zip(alone["roundtrip"], prompts, strict=True):
        assert ids == factory.tokenizer(prompt, add_special_tokens=False).input_ids
        assert text == factory.tokenizer.decode(ids)
    saved = json.loads((tiny_mixture / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only"} & set(saved)


def test_the_modeling_files_import_only_torch_and_transformers(tiny_mixture):
    import ast

    allowed = {"__future__", "logging", "math", "re", "collections", "torch", "transformers"}
    for name in ("modeling_dipaco.py", "configuration_dipaco.py"):
        tree = ast.parse((tiny_mixture / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.level == 0}
        assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}"


def test_transformers_in_process_generates_what_dipaco_load_generates(tiny_mixture, prompts, factory):
    """The quick form of the slow test above (here dipaco is importable, but the modeling file does not import it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_mixture, trust_remote_code=True)
    assert tok.model_max_length == factory.config.sharding.seq_len
    assert not {"is_local", "local_files_only"} & set(json.loads((tiny_mixture / "tokenizer_config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(tiny_mixture, trust_remote_code=True)
    mixture = dipaco.load(tiny_mixture)
    for prompt in prompts[:4]:
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        completion = mixture.complete(prompt, max_new_tokens=6)
        assert (model.last_paths[0], new.tolist()) == (completion.path, completion.tokens.tolist())


def test_the_model_card_parses_as_hub_metadata(tiny_mixture, tiny_trained):
    from huggingface_hub import ModelCard

    card = ModelCard.load(tiny_mixture / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["license"] and {"dipaco", "mixture-of-paths"} <= set(data["tags"])
    measured = json.loads(tiny_trained.eval_results.read_text())["models"]
    assert [(r.metric_name, r.metric_value) for r in card.data.eval_results] == \
        [(f"perplexity ({row['model']})", round(row["perplexity"], 4)) for row in measured]
    config = json.loads((tiny_mixture / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dipaco.DipacoMixtureForCausalLM"
    assert config["llama"]["rope_theta"] == config["llama"]["rope_parameters"]["rope_theta"]  # transformers 4 and 5


def test_a_2x2_export_stores_each_module_once(factory, tmp_path):
    """Forced into several shards: every module's tensors appear once across them, as the topology names
    them; the directory and its files have normal permissions."""
    out = export_mixture(factory, rounds={p: factory.store.current_round() for p in range(4)}, out=tmp_path / "hub",
                         shard_bytes=64 * 1024)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    names = []
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            names += [n for n in f.keys() if n.startswith("grid.")]
    round = factory.store.current_round()
    expected = [f"grid.{m}.{p}" for m in factory.topology.modules for p in factory.store.read_module(round, m)]
    assert len(factory.topology.modules) == 5  # the embeddings and 2 x 2 level modules, shared by 4 paths
    assert sorted(names) == sorted(expected)
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert {n for n in index if n.startswith("grid.")} == set(expected)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask
    for folder, dirs, files in os.walk(out):
        assert all(os.stat(os.path.join(folder, d)).st_mode & 0o777 == 0o777 & ~umask for d in dirs)
        assert all(os.stat(os.path.join(folder, f)).st_mode & 0o777 == 0o666 & ~umask for f in files)


def test_dipaco_generate_reads_an_exported_directory(tiny_mixture, prompts, capsys):
    from cli_helpers import dipaco_in_process

    code, log = dipaco_in_process("generate", prompts[0], "--run", tiny_mixture, "--max-new-tokens", "5")
    assert code == 0, log
    completion = dipaco.load(tiny_mixture).complete(prompts[0], max_new_tokens=5)
    assert capsys.readouterr().out.splitlines()[-1] == completion.text
    code, log = dipaco_in_process("generate", prompts[0], "--run", tiny_mixture, "--round", "1")
    assert code == 1 and "is an exported mixture" in log
