# Two commands do all the set-up on a fresh machine with Python 3.11 and pip:
#   make run    installs into .venv, then runs the main job
#   make test   installs into .venv (with test extras), then runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch 2.13.0 first: on these machines it is a local CPU build; an unpinned request would pull
# a multi-GB CUDA build.  The package itself keeps torch>=2.4 open for users.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/duplexrt simulate --concurrency 96 --frames 256

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
