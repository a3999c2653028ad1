# Everything a fresh machine needs: a .venv in the repo, torch 2.13.0 (CPU) first so no
# other requirement can pull a different torch, then the plugin with its extras.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test lint demo clean

$(STAMP): setup.py Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[fairseq,fairscale,test]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check fairseq_shard_plugin tests benchmarks

test: lint
	$(PY) -m pytest -q tests

demo: install
	$(PY) -m benchmarks.demo

clean:
	rm -rf $(VENV) demo_work *.egg-info
