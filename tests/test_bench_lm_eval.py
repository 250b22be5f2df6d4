"""bench/bench_lm_eval.py's pure parts: the table of models x task metrics with standard errors and the held-out
perplexity, the routings' eval modes, and the count of task passages that open a training document."""

from __future__ import annotations

import numpy as np

from bench.bench_lm_eval import count_trained, figure, held_out_perplexity, markdown


def record(results: dict, perplexity: dict, overlap: dict) -> dict:
    return {"title": "t", "run_command": "make demo", "run_seconds": 600.0, "run_precision": "bf16", "export": "runs/demo-mixture",
            "export_seconds": 5.0, "eval_seconds": 60.0, "tasks": ["dipaco_demo"], "limit": None, "overlap": overlap,
            "held_out_perplexity": perplexity, "lm_eval": results}


def test_the_table_has_a_row_per_model_a_column_per_metric_and_the_held_out_perplexity():
    mixture = {"dipaco_demo": {"alias": "dipaco_demo"},
               "dipaco_demo_continuation": {"alias": "c", "acc,none": 0.625, "acc_stderr,none": 0.1009},
               "dipaco_demo_text": {"alias": "t", "word_perplexity,none": 1234.567, "word_perplexity_stderr,none": "N/A"}}
    dense = {"dipaco_demo_continuation": {"alias": "c", "acc,none": 0.5, "acc_stderr,none": 0.1043}}
    results = {"DiPaCo (router routing)": mixture, "dense-equal-steps": dense}
    text = markdown(record(results, {"DiPaCo (router routing)": 93.456}, {}))
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[0] == ("| model | dipaco_demo_continuation acc | dipaco_demo_text word_perplexity "
                        "| held-out perplexity (dipaco eval) |")
    assert table[2] == f"| DiPaCo (router routing) | {figure(0.625)} ± {figure(0.1009)} | {figure(1234.567)} | {figure(93.456)} |"
    assert table[3] == f"| dense-equal-steps | {figure(0.5)} ± {figure(0.1043)} | - | - |"
    assert (figure(0.625), figure(1234.567)) == ("0.6250", "1234.57")
    assert "training data" not in text


def test_the_overlap_line_says_when_the_passages_are_training_documents():
    overlap = {"dipaco_demo_text": {"passages": 12, "trained_on": 11, "held_out": 1, "not_found": 0}}
    text = markdown(record({}, {}, overlap))
    assert "11 of 12 passages open a document of the run's train split, 1 only documents it held out" in text
    assert "on their training data, not held-out quality" in text


def test_each_routing_takes_its_eval_modes_perplexity_and_each_baseline_its_own():
    evaluation = {"models": [{"model": "DiPaCo 2x2 routed", "perplexity": 93.0}, {"model": "dense-equal-steps", "perplexity": 112.0}],
                  "modes": {"rows": [{"mode": "prefix", "checkpoints": "last", "perplexity": 93.0},
                                     {"mode": "likelihood", "checkpoints": "best", "perplexity": 90.0},
                                     {"mode": "likelihood", "checkpoints": "last", "perplexity": 92.0},
                                     {"mode": "oracle", "checkpoints": "last", "perplexity": 89.0}]}}
    assert held_out_perplexity(evaluation) == {"dense-equal-steps": 112.0, "DiPaCo (router routing)": 93.0,
                                               "DiPaCo (likelihood routing)": 92.0}
    assert held_out_perplexity({}) == {}


def test_a_passage_counts_as_trained_on_when_a_train_document_opens_with_it():
    texts = ["In the beginning God", "In the beginning was", "def f(x): return x", "use strict;"]
    splits = np.array([1, 0, 1, 0])  # TEST, TRAIN, TEST, TRAIN
    counts = count_trained(["In the beginning", "def f(x)", "my $x", "use strict;"], texts, splits, train=0)
    assert counts == {"passages": 4, "trained_on": 2, "held_out": 1, "not_found": 1}
