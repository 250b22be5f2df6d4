"""The model card (`README.md`) of an exported mixture: Hugging Face hub metadata in YAML front matter, then
what the mixture is, how to load it, and the perplexities the run's `eval.json` measured.

    text = model_card(CardFacts(name="demo", levels=[2, 2], ...), eval_results=json.loads(...))

The metadata: `library_name: transformers`, `license`, `tags` (dipaco, mixture-of-paths, ...),
`pipeline_tag: text-generation`, `datasets` (when the corpus is a hub dataset) and `model-index` rows
of the measured perplexities. The bundled demo corpus mixes three licences, so its `license` is
`other` with each source's licence named in the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

DEMO_LICENCES = ("bible-kjv: public domain", "python-docs: PSF License", "perl-docs: GPL-1+ or the Artistic License")


@dataclass(frozen=True)
class CardFacts:
    """What the card says about the export (all read from the run and the export)."""

    name: str  # the repository's name (the output directory's)
    corpus: str  # corpus.path: "demo", a local file, or a hub dataset name
    levels: list[int]  # modules per level
    n_paths: int  # routed paths in the export
    modules: int  # modules stored (each once)
    params_per_path: int  # parameters of one path model
    prefix_tokens: int  # routing prefix
    max_length: int  # the sequence length paths saw
    route: str  # "router" or "likelihood"
    featurizer: str  # the router's featurizer ("tfidf", "base-model", "hf")
    rounds: dict[int, int]  # module version of each path
    fallback: str | None = None  # why the modeling file routes by likelihood though the run routed by its router


def _is_hub_dataset(corpus: str) -> bool:
    """A corpus name that names a hub dataset (not the demo, not a local path or glob)."""
    local = corpus.startswith(("/", ".", "~")) or any(c in corpus for c in "*?") or "." in corpus.rsplit("/", 1)[-1]
    return corpus != "demo" and not local


def metadata(facts: CardFacts, eval_results: dict[str, Any] | None) -> dict[str, Any]:
    """The card's YAML front matter (hub metadata)."""
    meta: dict[str, Any] = {
        "library_name": "transformers",
        "license": "other",  # the training data's licence(s), named in the text
        "license_name": "training-data-licences",
        "tags": ["dipaco", "mixture-of-paths", "llama", "custom_code", "text-generation"],
        "pipeline_tag": "text-generation",
    }
    if _is_hub_dataset(facts.corpus):
        meta["datasets"] = [facts.corpus]
    rows = (eval_results or {}).get("models") or []
    if rows:
        meta["model-index"] = [{"name": facts.name, "results": [{
            "task": {"type": "text-generation", "name": "Language modeling"},
            "dataset": {"type": facts.corpus, "name": f"{facts.corpus} (held-out test documents)"},
            "metrics": [{"type": "perplexity", "name": f"perplexity ({row['model']})",
                         "value": round(float(row["perplexity"]), 4)}
                        for row in rows if row.get("perplexity") is not None]}]}]
    return meta


def model_card(facts: CardFacts, *, eval_results: dict[str, Any] | None) -> str:
    """README.md: the front matter, then the text."""
    front = yaml.safe_dump(metadata(facts, eval_results), sort_keys=False, allow_unicode=True)
    grid = "x".join(map(str, facts.levels))
    lines = [f"---\n{front}---", f"# {facts.name}", "",
             f"A DiPaCo mixture of {facts.n_paths} paths ({grid} modules, {facts.modules} stored once, "
             f"{facts.params_per_path:,} parameters per path), trained with "
             f"dipaco on `{facts.corpus}`. Each sequence is routed by its first "
             f"{facts.prefix_tokens} tokens to one path, a Llama model built from its modules; paths saw "
             f"{facts.max_length} tokens at most.", "",
             "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             "tok = AutoTokenizer.from_pretrained(REPO, trust_remote_code=True)",
             "model = AutoModelForCausalLM.from_pretrained(REPO, trust_remote_code=True)",
             'ids = tok("In the beginning", return_tensors="pt").input_ids',
             "print(tok.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0]), model.last_paths)",
             "```", "", _routing_text(facts), "", _licence_text(facts), ""]
    lines += _eval_text(facts, eval_results)
    return "\n".join(lines) + "\n"


def _routing_text(facts: CardFacts) -> str:
    if facts.fallback:
        return (f"**Routing: likelihood (fallback).** The run routed with a `{facts.featurizer}` k-means router, "
                f"which the modeling file cannot reproduce ({facts.fallback}); `modeling_dipaco.py` routes each "
                f"sequence to the path that gives its first {facts.prefix_tokens} tokens the lowest loss instead. "
                f"`dipaco.load` (with dipaco installed) still routes by the router.")
    if facts.route == "likelihood":
        return (f"**Routing: likelihood.** Each sequence goes to the path that gives its first "
                f"{facts.prefix_tokens} tokens the lowest loss (every path scores the prefix).")
    return (f"**Routing: the k-means router** (`{facts.featurizer}` features of the prefix's text, the nearest "
            f"centroids), computed in `modeling_dipaco.py` with torch alone.")


def _licence_text(facts: CardFacts) -> str:
    if facts.corpus == "demo":
        return ("**Licence.** Trained on dipaco's bundled demo corpus, whose sources carry their own licences ("
                + "; ".join(DEMO_LICENCES) + "); the weights are offered under those terms. "
                "The modeling code is Apache-2.0 (dipaco's licence).")
    return (f"**Licence.** The weights follow the licence of the training data (`{facts.corpus}`); "
            "the modeling code is Apache-2.0 (dipaco's licence).")


def _eval_text(facts: CardFacts, eval_results: dict[str, Any] | None) -> list[str]:
    rows = (eval_results or {}).get("models") or []
    if not rows:
        return ["## Evaluation", "", "The run has no `eval.json` (run `dipaco eval`): no perplexity is reported."]
    rounds = sorted(set(facts.rounds.values()))
    note = ("" if rounds == [eval_results.get("round")] else
            f" (the export holds module version(s) {rounds}; these were measured at round {eval_results.get('round')})")
    out = ["## Evaluation", "",
           f"Perplexity on {eval_results.get('test_documents')} held-out test documents "
           f"({eval_results.get('scored_tokens')} tokens after each routing prefix), from the run's `eval.json`"
           f"{note}:", "", "| model | paths | parameters per path | perplexity |", "|---|---:|---:|---:|"]
    for row in rows:
        out.append(f"| {row['model']} | {row['paths']} | {row['params_per_path']:,} | {row['perplexity']:.4f} |")
    return out
