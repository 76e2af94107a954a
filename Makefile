# The two set-up commands: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
# test workers: the suite's modules run side by side (2 cores on CI); TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2

.PHONY: serve test install install-dev bench clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard native/*.cpp native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch from the pinned release; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(VENV)/bin/constrained-spec serve --host $(HOST) --port $(PORT) $(ARGS)

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -rs --durations=25 -n $(TEST_WORKERS) --dist loadfile $(ARGS)

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/bench_cpu.py

clean:
	rm -rf build *.egg-info constrained_spec/_native*.so
