# modbench: `make quick` runs the main job (the quick study and its report), `make test` runs
# the tests. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
BENCH  ?= cpu# results name: reports/bench/$(BENCH).json and .md (e.g. BENCH=h100 on a GPU)
STAMP  := $(VENV)/.installed

.PHONY: install quick demo test bench clean paper-claims

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

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
