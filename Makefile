# Two entry points that work on a fresh machine with Python 3.11:
#   make train [ARGS="key=value ..."]   train the embedded default (or any Hydra overrides)
#   make test  [PYTEST_ARGS="..."]      the CPU test tier (GPU tests skip without CUDA), in PYTEST_JOBS
#                                       pytest-xdist workers (default 2; 0 runs in this process)
#   make lint                           ruff check and ruff format --check (pyproject.toml; CI runs it)
#   make install                        .venv with the pins, and the other Tritons of the sm_90 compile check
PYTHON ?= python3
VENV := .venv
TORCHREC := torchrec==1.8.0
STAMP := $(VENV)/.installed
PYTEST_JOBS ?= 2

# The sm_90 compile check (tests/kernels/test_jagged_attention.py) runs with each Triton release of
# gem.versions.KNOWN_GOOD (each combination's triton_pin). The venv has
# requirements-cpu.txt's; every other one is installed on its own (no dependencies) into .venv/triton-<version>/,
# which the test puts first on PYTHONPATH.
KNOWN_TRITONS := $(shell $(PYTHON) -c 'import runpy; \
	print(*sorted({c.triton_pin for c in runpy.run_path("gem/versions.py")["KNOWN_GOOD"]}))')
ifeq ($(KNOWN_TRITONS),)
$(error could not read the Triton pins of gem.versions.KNOWN_GOOD with $(PYTHON))
endif
VENV_TRITON := $(shell sed -n 's/^triton==\([^ ]*\).*/\1/p' requirements-cpu.txt)
OTHER_TRITONS := $(filter-out $(VENV_TRITON),$(KNOWN_TRITONS))

.PHONY: train test lint install clean-cache

install: $(STAMP) $(OTHER_TRITONS:%=$(VENV)/triton-%/.installed)

$(STAMP): requirements-cpu.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r requirements-cpu.txt
	$(VENV)/bin/python -m pip install -q --no-deps $(TORCHREC)
	$(VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(VENV)/triton-%/.installed: | $(STAMP)
	rm -rf $(@D)
	$(VENV)/bin/python -m pip install -q --no-deps --target $(@D) triton==$*
	touch $@

train: $(STAMP)
	$(VENV)/bin/python -m gem.train $(ARGS)

test: install
	$(VENV)/bin/python -m pytest -n $(PYTEST_JOBS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-cache:
	rm -rf .cache/gem
