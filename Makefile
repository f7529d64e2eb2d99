# Two entry points that work on a fresh machine with Python 3.11:
#   make train [ARGS="key=value ..."]   train the embedded default (or any Hydra overrides)
#   make test  [PYTEST_ARGS="..."]      the CPU test tier (GPU tests skip without CUDA), in PYTEST_JOBS
#                                       pytest-xdist workers (default 2; 0 runs in this process)
#   make lint                           ruff check and ruff format --check (pyproject.toml; CI runs it)
PYTHON ?= python3
VENV := .venv
TORCHREC := torchrec==1.8.0
STAMP := $(VENV)/.installed
PYTEST_JOBS ?= 2

.PHONY: train test lint install clean-cache

install: $(STAMP)

$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r requirements-cpu.txt
	$(VENV)/bin/python -m pip install -q --no-deps $(TORCHREC)
	$(VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python -m gem.train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(PYTEST_JOBS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-cache:
	rm -rf .cache/gem
