# Two commands do all the set-up on a fresh machine with Python 3.11 and pip:
#   make run    installs into .venv, then runs the main job: `duplexrt serve` (echo model, port 8000)
#   make test   installs into .venv (with test extras), then runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# packaging/install.sh is the install sequence the wheel test and the Dockerfile use too:
# torch 2.13.0 first (on these machines a local CPU build; an unpinned request would pull a
# multi-GB CUDA build; the package itself keeps torch>=2.4 open for users), then duplexrt, then
# the moshi package without its version pins (see the script for why).
$(VENV)/.installed: pyproject.toml Makefile packaging/install.sh | $(BIN)/python
	PIP='$(BIN)/python -m pip' sh packaging/install.sh -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/duplexrt serve

test: install
	NO_TORCH_COMPILE=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
