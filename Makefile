# modbench: `make quick` runs the main job (the quick study and its report), `make test` runs
# the tests. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
BENCH  ?= cpu# results name: reports/bench/$(BENCH).json and .md (e.g. BENCH=h100 on a GPU)
STAMP  := $(VENV)/.installed

.PHONY: install quick demo test bench cpu-decode-bench clean paper-claims gpu-bench gpu-bench-setup gpu-bench-report

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 first: a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev,postgres,dashboard]"
	touch $(STAMP)

install: $(STAMP)

# The main job: two workers, one thread each (how its README time was measured), then the report.
quick: $(STAMP)
	( OMP_NUM_THREADS=1 $(BIN)/modbench study run studies/quick.toml --quiet & \
	  OMP_NUM_THREADS=1 $(BIN)/modbench study run studies/quick.toml; wait )
	$(BIN)/modbench report studies/quick.toml

# The reference study (reports/paper_claims/): two workers, one thread each, then the report.
paper-claims: $(STAMP)
	( OMP_NUM_THREADS=1 $(BIN)/modbench study run paper_claims --quiet & \
	  OMP_NUM_THREADS=1 $(BIN)/modbench study run paper_claims --quiet; wait )
	$(BIN)/modbench report paper_claims

demo: $(STAMP)
	$(BIN)/modbench demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

bench: $(STAMP)
	mkdir -p reports/bench
	$(BIN)/python -m pytest tests/bench --benchmark-enable --benchmark-json=reports/bench/$(BENCH).json --benchmark-group-by=group -q
	$(BIN)/python -m modbench.bench.table reports/bench/$(BENCH).json --markdown reports/bench/$(BENCH).md

# The CPU decode table (reports/bench/cpu_decode.*): every variant at batch 1, 8 and 64, one batch
# a pytest run (a run cut short loses only its batch), one thread (MODBENCH_BENCH_THREADS: on a
# loaded 2-core machine a 2-thread region waits for its descheduled thread at every op).
cpu-decode-bench: $(STAMP)
	mkdir -p reports/bench
	for B in 1 8 64; do \
	  MODBENCH_BENCH_THREADS=1 $(BIN)/python -m pytest -q tests/bench/test_decode_speed.py -k "cpu and B$$B-" \
	    --benchmark-enable --benchmark-json=reports/bench/cpu_decode-B$$B.json --benchmark-group-by=group || exit 1; \
	done
	$(BIN)/python -m modbench.bench.table reports/bench/cpu_decode-B1.json reports/bench/cpu_decode-B8.json \
	  reports/bench/cpu_decode-B64.json --write-json reports/bench/cpu_decode.json --markdown reports/bench/cpu_decode.md
	rm -f reports/bench/cpu_decode-B*.json

# The GPU measurements (bf16, torch.compile, synchronised timing) on a machine with CUDA and no
# network: its own python3 (GPU_PYTHON) holds a CUDA torch, pytest, pytest-benchmark, pandas,
# tabulate and rich, and neither MLflow nor Optuna (the benchmarks import neither), so no venv is
# built and nothing is installed: the package is laid out as `modbench` under build/gpu-pkg (a
# copy of harness/, variants/ and studies/, remade by every part) and put on PYTHONPATH.
#   make gpu-bench                  # all four parts, then reports/bench/$(BENCH).json and .md
#   make gpu-bench-mfu              # one part: reports/bench/$(BENCH)-mfu.json (also -decode, -block, -model)
#   make gpu-bench-report           # the table over the parts' JSONs that exist
#   make gpu-smoke                  # a few CUDA training steps of `modbench train` (bf16 autocast, no tracking)
# The results' name follows the GPU (h100, h200, a100, ...: GPU_NAME, from nvidia-smi). Each part is
# one pytest run (and one JSON), so a part cut short loses only itself. GPU_K_<part> is its pytest
# -k selection: the defaults time the issue's measurements (dense MFU, decoding, sigmoid blocks at
# every T and C, the model at C = 0.125); GPU_K_block=cuda times every variant (about 115
# compiled entries: run it on its own).
GPU_PYTHON   ?= python3
GPU_PKG      := build/gpu-pkg
GPU_RUN       = PYTHONPATH=$(CURDIR)/$(GPU_PKG)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON)
# "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100; "gpu" where nvidia-smi says nothing.
GPU_NAME      = $(or $(shell nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | \
                  grep -oiE '\b[a-z]+[0-9]+[a-z]*\b' | grep -viE '^(nvidia|[0-9]+gb)$$' | head -n 1 | tr A-Z a-z),gpu)
GPU_PARTS    := mfu decode block model
GPU_K_mfu    ?= cuda
GPU_K_decode ?= cuda
GPU_K_block  ?= cuda and (dense or sigmoid)
GPU_K_model  ?= cuda and (dense or sigmoid-C0.125)
GPU_SMOKE_STEPS ?= 20
.PHONY: gpu-smoke $(GPU_PARTS:%=gpu-bench-%)
gpu-bench gpu-bench-setup gpu-bench-report gpu-smoke $(GPU_PARTS:%=gpu-bench-%): BENCH = $(GPU_NAME)

gpu-bench-setup:
	$(GPU_PYTHON) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'gpu-bench: no CUDA device')"
	rm -rf $(GPU_PKG) && mkdir -p $(GPU_PKG)
	cp -R harness $(GPU_PKG)/modbench && cp -R variants $(GPU_PKG)/modbench/variants && cp -R studies $(GPU_PKG)/modbench/studies
	$(GPU_RUN) -c "import modbench.model.gpt, modbench.bench.table, modbench.run.train"
	mkdir -p reports/bench

$(GPU_PARTS:%=gpu-bench-%): gpu-bench-%: gpu-bench-setup
	$(GPU_RUN) -m pytest -p no:cacheprovider -q tests/bench/test_$(if $(filter $*,mfu),mfu,$*_speed).py \
	  -k "$(GPU_K_$*)" --benchmark-enable --benchmark-json=reports/bench/$(BENCH)-$*.json --benchmark-group-by=group

gpu-bench-report:
	$(GPU_RUN) -m modbench.bench.table $(wildcard $(GPU_PARTS:%=reports/bench/$(BENCH)-%.json)) \
	  --write-json reports/bench/$(BENCH).json --markdown reports/bench/$(BENCH).md

gpu-bench: $(GPU_PARTS:%=gpu-bench-%)
	$(MAKE) --no-print-directory gpu-bench-report BENCH=$(BENCH) GPU_PYTHON=$(GPU_PYTHON)

gpu-smoke: gpu-bench-setup
	$(GPU_RUN) -m modbench.cli.main train --device cuda --budget steps=$(GPU_SMOKE_STEPS) --variant sigmoid \
	  --capacity 0.125 --dataset stdlib --eval-every 10 --out-dir build/gpu-smoke --no-track --quiet

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
