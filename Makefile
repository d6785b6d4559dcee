# Two entry points, each building its own virtual environment from nothing:
#   make demo   runs the main job on the embedded default (CPU, no download)
#   make test   runs the whole test suite (unit tests, then Triton-interpreter tests in their own process)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ludic-fast demo

test: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/interpret
	if [ -d tests/interpret ]; then TRITON_INTERPRET=1 $(PY) -m pytest -q tests/interpret; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
