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
	OMP_NUM_THREADS=1 $(BIN)/modbench study run studies/quick.toml --workers 2
	$(BIN)/modbench report studies/quick.toml

# The reference study (reports/paper_claims/): two workers, one thread each, then the report.
paper-claims: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/modbench study run paper_claims --workers 2 --quiet
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

# Every decoder of generate side by side at that shape on this CPU, masked and under torch.cond (issue 38):
# dense and sigmoid fixed:1,1 C = 0.125, batch 1, 8, 64 → reports/bench/decode-static-cpu.md and .json.
.PHONY: cpu-decode-static
cpu-decode-static: $(STAMP)
	$(BIN)/python -m modbench.bench.gpu_decode --cpu --out reports/bench

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
	$(MAKE) --no-print-directory gpu-pkg GPU_PYTHON=$(GPU_PYTHON)
	mkdir -p reports/bench

# The package laid out as `modbench` (no install on the GPU machine), with the kit's commit when there is one.
.PHONY: gpu-pkg
gpu-pkg:
	rm -rf $(GPU_PKG) && mkdir -p $(GPU_PKG)
	cp -R harness $(GPU_PKG)/modbench && cp -R variants $(GPU_PKG)/modbench/variants && cp -R studies $(GPU_PKG)/modbench/studies
	if [ -f $(GPU_KIT)/BUILD_COMMIT ]; then cp $(GPU_KIT)/BUILD_COMMIT $(GPU_PKG)/modbench/BUILD_COMMIT; fi
	$(GPU_RUN) -c "import modbench.model.gpt, modbench.bench.table, modbench.run.train"

# --- A study on one lent GPU, in one slot (modbench.study.slot; README "Studies on a lent GPU") ------
# Here, on a CPU machine with network (commit first: the kit records the commit):
#   make gpu-kit                    # build/gpu-kit: the wheels the GPU machine lacks, the stdlib corpus, the commit
# There, on the lent machine (carry build/gpu-kit; the archive and the probe's table come back through $OUT):
#   make gpu-study STUDY=paper_claims_gpu MINUTES=8.5   # WORKERS=auto: first measures AUTO_WORKERS (4,8), same call
#   make gpu-probe STUDY=paper_claims_gpu   # the probe alone: trials/minute for N = 1, 2, 4, 8 workers (COMPILE=off,on)
# Here again: modbench study import <archive>; modbench report paper_claims_gpu.
# A study cut off by its deadline resumes: on the same machine from its folder, on the next one from
# the archive copied to $(GPU_KIT)/archives/<study>.tar.gz (carried with the kit).
#   make gpu-study-dry              # the same command on this CPU, a tiny study, no wheels: CI runs it
GPU_KIT      ?= build/gpu-kit
GPU_SITE     := build/gpu-site
STUDY        ?= paper_claims_gpu
STUDY_NAME    = $(basename $(notdir $(STUDY)))
WORKERS      ?= auto
AUTO_WORKERS ?= 4,8
MINUTES      ?= 8
SLOT_OUT     ?= $(or $(OUT),build/slot)
RESUME       ?= $(wildcard $(GPU_KIT)/archives/$(STUDY_NAME).tar.gz)
SLOT_RUN      = MODBENCH_STDLIB_FILE=$(abspath $(firstword $(wildcard $(GPU_KIT)/data/stdlib-*.bin))) \
                PYTHONPATH=$(CURDIR)/$(GPU_PKG):$(CURDIR)/$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON)
PROBE_ARMS   ?= dense
PROBE_BUDGET ?= flops=5e14
PROBE_WORKERS ?= 1,2,4,8
PROBE_DEVICE ?= cuda
.PHONY: gpu-kit gpu-study gpu-study-dry gpu-site gpu-probe

gpu-kit: $(STAMP)
	$(BIN)/python tools/gpu_kit.py $(GPU_KIT) $(GPU_KIT_FLAGS)

# The kit's wheels installed beside the package, without network (nothing to install: the packages are here).
gpu-site:
	rm -rf $(GPU_SITE) && mkdir -p $(GPU_SITE)
	if ls $(GPU_KIT)/wheels/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --target $(GPU_SITE) $(GPU_KIT)/wheels/*.whl; fi

gpu-study: gpu-site gpu-pkg
	$(SLOT_RUN) -m modbench.cli.main study slot $(STUDY) --workers $(WORKERS) --probe-workers $(AUTO_WORKERS) --minutes $(MINUTES) \
	  --archive $(SLOT_OUT)/$(STUDY_NAME).tar.gz --out-dir build/slot-work $(if $(RESUME),--resume $(RESUME))

# How many workers: every N trains the same arm (PROBE_ARMS) at a small budget, compile off (on: COMPILE=off,on).
gpu-probe: gpu-site gpu-pkg
	mkdir -p $(SLOT_OUT)
	$(SLOT_RUN) -m modbench.study.workers_probe $(STUDY) --workers $(PROBE_WORKERS) --compile $(or $(COMPILE),off) \
	  --device $(PROBE_DEVICE) \
	  --arms "$(PROBE_ARMS)" --budget $(PROBE_BUDGET) --trials-per-worker 1 --timeout-s 120 \
	  --json $(SLOT_OUT)/$(STUDY_NAME)-probe.json --markdown $(SLOT_OUT)/$(STUDY_NAME)-probe.md

# CI's dry run of the kit: the very same targets on this CPU with the venv's Python, a tiny study,
# the kit without wheels; then the archive is imported and reported as a GPU study's would be.
DRY_DIR := build/gpu-dry
gpu-study-dry: $(STAMP)
	rm -rf $(DRY_DIR) build/slot-work/slot/slot_dry
	$(MAKE) --no-print-directory gpu-kit GPU_KIT=$(DRY_DIR)/kit GPU_KIT_FLAGS=--no-wheels
	$(MAKE) --no-print-directory gpu-probe GPU_KIT=$(DRY_DIR)/kit GPU_PYTHON=$(abspath $(BIN)/python) \
	  STUDY=tests/studies/slot_dry.toml SLOT_OUT=$(DRY_DIR)/out PROBE_WORKERS=1,2 PROBE_DEVICE=cpu PROBE_BUDGET=steps=3
	$(MAKE) --no-print-directory gpu-study GPU_KIT=$(DRY_DIR)/kit GPU_PYTHON=$(abspath $(BIN)/python) \
	  STUDY=tests/studies/slot_dry.toml WORKERS=auto AUTO_WORKERS=1,2 MINUTES=4 SLOT_OUT=$(DRY_DIR)/out RESUME=
	$(BIN)/modbench study import $(DRY_DIR)/out/slot_dry.tar.gz --out-dir $(DRY_DIR)/studies \
	  --tracking-uri sqlite:///$(abspath $(DRY_DIR))/mlflow.db
	$(BIN)/modbench report tests/studies/slot_dry.toml --out-dir $(DRY_DIR)/studies --reports-dir $(DRY_DIR)/reports \
	  --tracking-uri sqlite:///$(abspath $(DRY_DIR))/mlflow.db
	test -s $(DRY_DIR)/reports/slot_dry/report.md && echo "gpu-study-dry: report at $(DRY_DIR)/reports/slot_dry/report.md"

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

# The static decode step on a lent GPU (issue 38): first the CUDA-only exactness tests of tests/test_static_decode.py
# (the CUDA graph, its conditional nodes and its split pieces against the eager step) and of tests/test_cuda_graphs.py
# (the capture mechanics; their log → decode-cuda-tests.txt,
# a failure does not stop the bench), then dense and sigmoid fixed:1,1 C = 0.125 at batch 1, 8 and 64, the old decoder
# against the static step (eager, CUDA graph, compiled; masked, under torch.cond, and split at its branches), one
# process → $(or $(OUT),reports/bench)/decode-static-<gpu>.md and .json (modbench.bench.gpu_decode; --dry-run is its
# CPU check, tests/bench/test_gpu_decode.py). STEPS=dynamic,static-cond,graph,graph-split,reference-graph skips the
# compiled cells (each compiles the whole 12-layer step, or its four parts).
# DECODE_TESTS="cuda and not compile" runs the tests of the uncompiled steps alone (with STEPS that skip the compiles).
DECODE_TESTS ?= cuda
.PHONY: gpu-decode-bench
gpu-decode-bench: gpu-pkg
	mkdir -p $(or $(OUT),reports/bench)
	-$(GPU_RUN) -m pytest -q -p no:cacheprovider tests/test_static_decode.py tests/test_cuda_graphs.py -k "$(DECODE_TESTS)" \
	  > $(or $(OUT),reports/bench)/decode-cuda-tests.txt 2>&1; tail -n 3 $(or $(OUT),reports/bench)/decode-cuda-tests.txt
	$(GPU_RUN) -m modbench.bench.gpu_decode --out $(or $(OUT),reports/bench) $(if $(STEPS),--steps $(STEPS))

# The routed block's and the model step's bars (issue 38): sigmoid and norm blocks at C = 0.125, B 32, T 2048, d 1024,
# and the depth-4 alternate GPT's training step, against dense, eager / compiled / CUDA graphs (reduce-overhead),
# one process → $(or $(OUT),reports/bench)/bars-<gpu>.md and .json (modbench.bench.gpu_bars; tests/bench/test_gpu_bars.py).
# MODES=eager,cudagraphs (or BARS=block) runs a part. First the training side's CUDA-only tests (the routed models'
# forward and backward without a sync, the mixtures of experts' bf16 grouped GEMMs against their per-slice loop; their
# log → bars-cuda-tests.txt, a failure does not stop the bars).
.PHONY: gpu-bars
gpu-bars: gpu-pkg
	mkdir -p $(or $(OUT),reports/bench)
	-$(GPU_RUN) -m pytest -q -p no:cacheprovider tests/test_grouped_mm.py tests/bench/test_compile.py -k cuda \
	  > $(or $(OUT),reports/bench)/bars-cuda-tests.txt 2>&1; tail -n 3 $(or $(OUT),reports/bench)/bars-cuda-tests.txt
	$(GPU_RUN) -m modbench.bench.gpu_bars --out $(or $(OUT),reports/bench) $(if $(MODES),--modes $(MODES)) $(if $(BARS),--bars $(BARS))

# Where the dense layer's eager time goes (issue 38 item 3): nanoGPT's block shape with modbench's norm and RoPE
# added one at a time, then modbench's DenseLayer, interleaved, profiled per category →
# $(or $(OUT),reports/bench)/dense-layer-<gpu>.md and .json (modbench.bench.dense_layer; tests/bench/test_dense_layer.py).
.PHONY: gpu-dense-profile
gpu-dense-profile: gpu-pkg
	mkdir -p $(or $(OUT),reports/bench)
	$(GPU_RUN) -m modbench.bench.dense_layer --device cuda --json $(or $(OUT),reports/bench)/dense-layer-$(GPU_NAME).json \
	  > $(or $(OUT),reports/bench)/dense-layer-$(GPU_NAME).md
