# Everything a fresh machine needs: a .venv in the repo, torch 2.13.0 (CPU) first so no
# other requirement can pull a different torch, then the plugin with its extras.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-unit lint demo memory gpu-wheels clean

$(STAMP): setup.py Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[fairseq,fairscale,test]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check fairseq_shard_plugin tests benchmarks launching

test: lint
	$(PY) -m pytest -q --durations=15 tests

# The in-process tests only (seconds; no fairseq launches): for quick iteration.
test-unit: lint
	$(PY) -m pytest -q -m "not e2e" tests

# Benchmarks draw charts with matplotlib (the "bench" extra).
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

# Per-rank memory and loss curves of the plugin and stock fairseq, written to
# demo_work/results/demo.* (python -m benchmarks.demo --out benchmarks/results refreshes the
# committed ones).
demo: $(BENCH_STAMP)
	$(PY) -m benchmarks.demo

# Per-rank memory breakdown at the NLLB-600M shape (about 12 minutes on 2 cores; its first
# three rows need more than 23.5 GiB of host memory: a swap file, see docs/memory.md).
memory: $(BENCH_STAMP)
	$(PY) -m benchmarks.memory

# Packages the GPU machine lacks (Python 3.12 there), as wheels, so that its install is a
# copy of files (seconds) instead of compiling fairseq (145 s): ve-fairseq's prebuilt cp312
# wheel and binary wheels of the other dependencies, plus pure-Python wheels built here
# (fairscale and antlr4 ship sdists only) and the plugin's own wheel.
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 \
		$(GPU_PLATFORMS) -d .whl ve-fairseq==0.12.3 hydra-core==1.3.2 omegaconf==2.3.0 \
		bitarray==3.12.3
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w .whl \
		fairscale==0.4.13 antlr4-python3-runtime==4.9.3 .
	ls -l .whl

clean:
	rm -rf $(VENV) demo_work *.egg-info
