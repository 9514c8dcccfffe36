# modbench: `make quick` runs the main job (the quick study and its report), `make test` runs
# the tests. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
BENCH  ?= cpu# results name: reports/bench/$(BENCH).json and .md (e.g. BENCH=h100 on a GPU)
STAMP  := $(VENV)/.installed

.PHONY: install quick demo test bench clean paper-claims gpu-bench gpu-bench-setup gpu-bench-report

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 first: a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev,postgres,dashboard]"
	touch $(STAMP)

install: $(STAMP)

quick: $(STAMP)
	$(BIN)/modbench study run studies/quick.toml
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

# The GPU measurements (bf16, torch.compile, synchronised timing) on a machine with CUDA and no
# network: its own python3 (GPU_PYTHON) holds a CUDA torch, pytest, pytest-benchmark, pandas,
# tabulate and rich, so no venv is built; modbench itself is installed editable, without deps.
#   make gpu-bench                  # all four parts, then reports/bench/$(BENCH).json and .md
#   make gpu-bench-mfu              # one part: reports/bench/$(BENCH)-mfu.json (also -decode, -block, -model)
#   make gpu-bench-report           # the table over the parts' JSONs that exist
# Each part is one pytest run (and one JSON), so a part cut short loses only itself. GPU_K_<part>
# is its pytest -k selection: the defaults time the issue's measurements (dense MFU, decoding,
# sigmoid blocks at every T and C, the model at C = 0.125) in an estimated 2-6 minutes a part,
# mostly compilation (an estimate, not a measurement); GPU_K_block=cuda times every variant
# (about 115 compiled entries: run it on its own).
GPU_PYTHON   ?= python3
GPU_PARTS    := mfu decode block model
GPU_K_mfu    ?= cuda
GPU_K_decode ?= cuda
GPU_K_block  ?= cuda and (dense or sigmoid)
GPU_K_model  ?= cuda and (dense or sigmoid-C0.125)
.PHONY: $(GPU_PARTS:%=gpu-bench-%)
gpu-bench gpu-bench-setup gpu-bench-report $(GPU_PARTS:%=gpu-bench-%): BENCH = h100

gpu-bench-setup:
	$(GPU_PYTHON) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'gpu-bench: no CUDA device')"
	$(GPU_PYTHON) -c "import modbench" 2>/dev/null || \
	  $(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	mkdir -p reports/bench

$(GPU_PARTS:%=gpu-bench-%): gpu-bench-%: gpu-bench-setup
	$(GPU_PYTHON) -m pytest -p no:cacheprovider -q tests/bench/test_$(if $(filter $*,mfu),mfu,$*_speed).py \
	  -k "$(GPU_K_$*)" --benchmark-enable --benchmark-json=reports/bench/$(BENCH)-$*.json --benchmark-group-by=group

gpu-bench-report:
	$(GPU_PYTHON) -m modbench.bench.table $(wildcard $(GPU_PARTS:%=reports/bench/$(BENCH)-%.json)) \
	  --write-json reports/bench/$(BENCH).json --markdown reports/bench/$(BENCH).md

gpu-bench: $(GPU_PARTS:%=gpu-bench-%)
	$(MAKE) --no-print-directory gpu-bench-report BENCH=$(BENCH) GPU_PYTHON=$(GPU_PYTHON)

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
