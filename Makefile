# dipaco — make targets people guess (`make help` lists them). Each pipeline stage is a thin call of the
# `dipaco` CLI and takes CONFIG=configs/<name>.yaml and RUN=runs/<name>; extra `section.key=value`
# overrides go in ARGS. Without CONFIG, a run that has a config.yaml uses its own (RUN=runs/demo by
# default), a new one configs/demo.yaml.
PYTHON ?= python3
CONFIG ?=
RUN ?= runs/$(if $(CONFIG),$(basename $(notdir $(CONFIG))),demo)
CONFIG_ARG = $(if $(CONFIG),--config $(CONFIG),$(if $(wildcard $(RUN)/config.yaml),,--config configs/demo.yaml))
PATH_ID ?= 0
ARGS ?=
TORCH_CPU ?= torch==2.13.0
DIPACO = $(PYTHON) -m dipaco
OFFLINE = HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: install demo run route shard train island islands coordinator status baselines eval report export lm-eval serve test test-slow lint bench bench-quality bench-islands bench-bytes bench-wire bench-grids bench-grids-large bench-scale experiments experiment gpu-check corpus corpus-manpages corpus-large clean help pretrain reroute simulate

help:  ## this list: each target with its description
	@echo "stage targets take CONFIG=configs/<name>.yaml (default: the run's own config.yaml) RUN=$(RUN) ARGS='section.key=value ...'"
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-zA-Z][a-zA-Z0-9_-]*:[^=]*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install:  ## the pinned CPU torch when no torch is installed (a GPU torch is left alone), then dipaco + test extras
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "keeping the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PYTHON) -m pip install "$(TORCH_CPU)"; \
	fi
	$(PYTHON) -m pip install -e ".[test]"

demo:  ## the whole pipeline on the bundled corpus
	$(OFFLINE) $(DIPACO) run --config configs/demo.yaml --run runs/demo $(ARGS)

run:  ## the whole pipeline on CONFIG into RUN: route, shard, train, baselines, eval, report (done stages skipped)
	$(DIPACO) run $(CONFIG_ARG) --run $(RUN) $(ARGS)

route:  ## train the tokenizer, fit the router, assign documents to paths
	$(DIPACO) route $(CONFIG_ARG) --run $(RUN) $(ARGS)

shard:  ## tokenize and pack each path's documents into checked shards
	$(DIPACO) shard $(CONFIG_ARG) --run $(RUN) $(ARGS)

train:  ## run (or resume) the outer rounds with local island processes
	$(DIPACO) train $(CONFIG_ARG) --run $(RUN) $(ARGS)

island:  ## a pull-based island pinned to path PATH_ID (run `make coordinator` too)
	$(DIPACO) island $(CONFIG_ARG) --run $(RUN) --pull --path $(PATH_ID) $(ARGS)

N ?= 4
islands:  ## the coordinator and N local island processes (= dipaco train hardware.islands=N)
	$(DIPACO) train $(CONFIG_ARG) --run $(RUN) hardware.islands=$(N) $(ARGS)

coordinator:  ## the round loop alone; islands are started elsewhere with `make island` / `dipaco island`
	$(DIPACO) coordinator $(CONFIG_ARG) --run $(RUN) $(ARGS)

WATCH ?= 0
status:  ## the live board of RUN: rounds, islands and their tasks, queue, goodput, bytes, per-path losses (WATCH=5 redraws)
	$(DIPACO) status --run $(RUN) --watch $(WATCH)

baselines:  ## train the dense baselines (equal steps, equal compute)
	$(DIPACO) baselines $(CONFIG_ARG) --run $(RUN) $(ARGS)

eval:  ## routed evaluation of the held-out documents against the dense baselines
	$(DIPACO) eval $(CONFIG_ARG) --run $(RUN) $(ARGS)

report:  ## report.md with plots in the run directory
	$(DIPACO) report $(CONFIG_ARG) --run $(RUN) $(ARGS)

EXPORT ?= $(RUN)-mixture
export:  ## the whole mixture (every path, the router, the tokenizer) as one directory, EXPORT=RUN-mixture (dipaco.load, serve, lm-eval)
	$(DIPACO) export $(EXPORT) --overwrite $(CONFIG_ARG) --run $(RUN) $(ARGS)

TASKS ?= dipaco_demo
ROUTE ?= router
LIMIT ?=
lm-eval:  ## the run's mixture and its dense baselines side by side in lm-evaluation-harness (TASKS=dipaco_demo ROUTE=router|likelihood LIMIT=n)
	$(DIPACO) export $(EXPORT) --baselines --overwrite $(CONFIG_ARG) --run $(RUN) $(ARGS)
	$(OFFLINE) $(PYTHON) -m dipaco.inference.side_by_side $(EXPORT) --tasks $(TASKS) --route $(ROUTE) \
		$(if $(LIMIT),--limit $(LIMIT)) --json $(EXPORT)-lm-eval.json

PORT ?= 8000
serve:  ## the exported mixture behind an HTTP completions endpoint on PORT (OpenAI-style /v1/completions)
	$(OFFLINE) $(DIPACO) serve $(EXPORT) --port $(PORT) --route $(ROUTE)

pretrain:  ## the dense warm start (ARGS='warm_start.fraction=0.25'), before route
	$(DIPACO) pretrain $(CONFIG_ARG) --run $(RUN) $(ARGS)

reroute:  ## one discriminative re-routing phase (needs corpus.router_fraction > 0), then train more rounds
	$(DIPACO) reroute $(CONFIG_ARG) --run $(RUN) $(ARGS)

simulate:  ## chaos simulation at paper scale (ARGS='simulate.learners=16'): goodput of data parallel, elastic, sync, async; JSON + PNG in RUN/simulate
	$(DIPACO) simulate $(CONFIG_ARG) --run $(RUN) $(ARGS)

test:  ## the test suite without the tests marked slow, on one worker per CPU (pytest-xdist; offline, one torch thread: tests/conftest.py)
	$(PYTHON) -m pytest -q -n auto --dist loadfile --durations=10

test-slow:  ## only the slow tests: killed / paused training resumed, a re-routing phase, a torchrun island, a Ray run through an island kill
	$(PYTHON) -m pytest -q -m slow --durations=10

# The standard benchmarks, each at the settings of its committed results file (bench/results/), one after the
# other: simulate ~1.5 min, speed ~3, routing ~4, memory ~5, islands (3 rounds, islands-smoke) ~20, quality at half the
# demo's budget ~11; about 45 min on 2 cores with other jobs on them (docs/benchmarks.md#make-bench says where each
# figure comes from). `make bench-islands` is the islands benchmark in full (20 rounds, bench/results/islands: ~2.5 h).
bench:  ## the standard benchmarks: simulate, speed, routing, memory, islands (short), quality (~45 min on 2 cores; results in bench/results/)
	$(OFFLINE) $(PYTHON) bench/bench_simulate.py
	$(OFFLINE) $(PYTHON) bench/bench_speed.py --repeats 5
	$(OFFLINE) $(PYTHON) bench/bench_routing.py --skip-training --points 50000 --featurize-docs 2000
	$(OFFLINE) $(PYTHON) bench/bench_memory.py
	$(OFFLINE) $(PYTHON) bench/bench_islands.py --rounds 3 --step-seconds 1 --name islands-smoke
	$(OFFLINE) $(PYTHON) bench/bench_paths.py --large-hidden 0 --no-diloco-own

bench-islands:  ## data parallel, sync and async rounds side by side: paced islands, failures, a straggler (~2.5 h; ARGS='--keep' resumes)
	$(OFFLINE) $(PYTHON) bench/bench_islands.py $(ARGS)

bench-bytes:  ## every pseudo-gradient codec and fragments side by side at the reduced demo, two seeds for the chosen one (~45 min on 2 cores; bench/results/compression*)
	$(OFFLINE) $(PYTHON) bench/bench_compression.py --only float32 int8 int4 "topk 1% 2b EF" "topk 1% 2b no EF" "topk 1% 4b EF" "topk 1% 4b no EF" "topk 3% 2b EF" "topk 3% 2b no EF" "topk 3% 4b EF" "topk 3% 4b no EF" "topk 10% 2b EF" "topk 10% 2b no EF" "topk 10% 4b EF" "topk 10% 4b no EF" --name compression $(ARGS)
	$(OFFLINE) $(PYTHON) bench/bench_compression.py --only float32 "float32, 3 fragments" "float32, 4 fragments" "int8, 3 fragments" "int8, 4 fragments" "topk 10% 4b EF, 3 fragments" "topk 10% 2b EF, 3 fragments" --chosen "float32, 3 fragments" "float32, 4 fragments" "topk 10% 2b EF, 3 fragments" --name compression-fragments $(ARGS)

bench-wire:  ## every byte on the wire: float32 DiLoCo against top-k 5% 2 bits, private modules local, the results downloaded; reduced demo, 100 rounds, seeds 0 and 1, ~1 h on 2 cores (bench/results/wire; ARGS='--keep' resumes)
	$(OFFLINE) $(PYTHON) bench/bench_compression.py --set sharding.seq_len=128 --set model.hidden_size=64 --set run.rounds=100 --seeds 0 1 --only "float32" "topk 5% 2b EF, private local, last int8, download results" --chosen "topk 5% 2b EF, private local, last int8, download results" $(ARGS)

bench-grids:  ## 2x2, 4x4 and 8x8 grids at one path size against dense models of 1x and 4x a path, then the 4x and 16x dense models at their own lr; 3 seeds (~2 h on 2 cores; bench/results/grid-scaling*)
	$(OFFLINE) $(PYTHON) bench/bench_grid_scaling.py $(ARGS)
	$(OFFLINE) $(PYTHON) bench/bench_grid_scaling.py --grids --warm-start 400 --dense 4 --dense-set inner.lr=1.5e-3 --name grid-scaling-dense4x-lr1.5e-3 $(ARGS)
	$(OFFLINE) $(PYTHON) bench/bench_grid_scaling.py --grids --warm-start 400 --dense 16 --dense-set inner.lr=1e-3 --name grid-scaling-dense16x-lr1e-3 $(ARGS)

LARGE_GRIDS = bench/bench_grid_scaling.py --config configs/large.yaml --set sharding.seq_len=128 --set model.hidden_size=64 \
	--set corpus.max_documents=330000 --set corpus.test_fraction=0.0013 --set routing.balance=1.5 --set routing.hf_batch_size=256 \
	--warm-start 400 --seeds 0 --islands 2 --name grid-scaling-large --keep
bench-grids-large: corpus-large  ## 2x2 to 16x16 grids on the large corpus's first 330,000 documents (balanced paths) against dense 1x and 4x at equal steps and equal compute; seed 0 (~3 h on 2 cores; bench/results/grid-scaling-large)
	$(OFFLINE) $(PYTHON) $(LARGE_GRIDS) --grids 2x2 4x4 8x8 16x16 --dense 1 --dense-compute 2x2 4x4 $(ARGS)
	$(OFFLINE) $(PYTHON) $(LARGE_GRIDS) --grids --dense 4 --dense-compute 4x4 --dense-set inner.lr=1.5e-3 $(ARGS)
	$(OFFLINE) $(PYTHON) $(LARGE_GRIDS) --grids 2x2 4x4 8x8 16x16 --dense 1 4 --dense-compute 2x2 4x4 --collect-only

bench-scale:  ## the systems benchmarks: store-only islands over s3, a 50 MB document, 256 paths, a million documents routed (~45-60 min on 2 cores)
	$(OFFLINE) $(PYTHON) bench/bench_store_only.py
	$(OFFLINE) $(PYTHON) bench/bench_huge_document.py
	$(OFFLINE) $(PYTHON) bench/bench_grid256.py --before-ref 8a614f5
	$(OFFLINE) $(PYTHON) bench/bench_routing_1m.py --max-seconds 1140

gpu-check:  ## the CUDA path in one command: demo on CUDA (precision auto), torchrun island (NCCL), compile, speed; one table (ARGS=--smoke: on the CPU)
	$(OFFLINE) $(PYTHON) bench/gpu_check.py $(ARGS)

lint:  ## ruff, then the import contracts in pyproject.toml (layers, no cycles)
	$(PYTHON) -m ruff check dipaco routing sharding tests scripts bench experiments
	lint-imports

corpus:  ## rebuild the bundled corpus from Debian's bible-kjv, python3.11-doc and perl-doc
	$(PYTHON) scripts/build_corpus.py

corpus-manpages:  ## build the second, less separable corpus (data/manpages.jsonl.zst) from Debian's manpages and manpages-dev
	$(PYTHON) scripts/build_manpages_corpus.py

corpus-large:  ## build the large corpus (data/large/, about 33x the bundled one in characters) from Debian's linux-source-6.1 and documentation packages
	nice -n 10 $(PYTHON) scripts/build_large_corpus.py

bench-quality:  ## DiPaCo vs DiLoCo vs dense in one run at the demo budget (over 20 min on one core; ARGS='--budget 4', '--config configs/manpages.yaml --name quality-manpages-full')
	$(OFFLINE) $(PYTHON) bench/bench_quality.py $(ARGS)

NAME ?=
experiments:  ## the research scripts in experiments/ (what each asked, its results: experiments/README.md); hours each on 2 cores
	@echo "experiments/: $$(cd experiments && ls *.py | sed 's/\.py$$//' | tr '\n' ' ')"
	@echo "run one with: make experiment NAME=capacity ARGS='--points 8x200 --jobs 1'  (results in experiments/results/)"

experiment:  ## one research script: NAME=recipe_search | capacity | outer_weighting | islands_target, ARGS its options
	@test -n "$(NAME)" || { echo "make experiment NAME=<script in experiments/, without .py>; make experiments lists them"; exit 2; }
	$(OFFLINE) $(PYTHON) experiments/$(NAME).py $(ARGS)

clean:  ## delete runs/ and the pytest and ruff caches
	rm -rf runs/ .pytest_cache .ruff_cache
