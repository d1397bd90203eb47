# Two commands do all the set-up on a fresh machine with Python 3.11 and pip:
#   make run    installs into .venv what `serve` needs (no torch, no test extras: about a minute the
#               first time), then runs the main job: `duplexrt serve` (echo model, port 8000)
#   make test   installs into .venv the full set (torch, moshi, test extras), then runs the whole
#               test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install clean mutation

$(BIN)/python:
	@echo "make: creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# packaging/install.sh is the install sequence the wheel test and the Dockerfile use too:
# torch 2.13.0 first (on these machines a local CPU build; an unpinned request would pull a
# multi-GB CUDA build; the package itself keeps torch>=2.4 open for users), then duplexrt, then
# the moshi package without its version pins (see the script for why).  `make run` asks it for
# duplexrt alone (--no-torch): the echo model needs neither torch nor the test extras.
# Two stamps tell the installs apart: .installed-serve (what `run` needs) and .installed-test (the
# full set, which is a superset, so it stamps both): `make run` then `make test` installs the rest,
# `make test` then `make run` installs nothing.  Each step prints a line as it starts.
# The warning filter hides setuptools' "Editable installation" notice (a banner of asterisks about
# folders named like the package, which is how a checkout is laid out): only that message.
INSTALL_DEPS := pyproject.toml Makefile packaging/install.sh
INSTALL := PYTHONWARNINGS='ignore:Editable installation:Warning' PIP='$(BIN)/python -m pip' sh packaging/install.sh

$(VENV)/.installed-serve: $(INSTALL_DEPS) | $(BIN)/python
	$(INSTALL) --no-torch -e .
	touch $@

$(VENV)/.installed-test: $(INSTALL_DEPS) | $(BIN)/python
	$(INSTALL) -e '.[test]'
	touch $@ $(VENV)/.installed-serve

install: $(VENV)/.installed-test

run: $(VENV)/.installed-serve
	$(BIN)/duplexrt serve

test: install
	NO_TORCH_COMPILE=1 $(BIN)/python -m pytest -q

# Mutation testing of the core modules (docs/mutation.md): a dev tool, outside CI and outside the
# test extras, installed here only.  Time-boxed: whatever is not done when MUTATION_SECONDS run
# out stays "not checked", and a later `make mutation` goes on from there (results are kept in
# mutants/).  MUTANTS picks the modules, as mutmut's name globs.
MUTATION_SECONDS ?= 3600
MUTATION_JOBS ?= 2
MUTANTS ?= "duplexrt.core.inbox*" "duplexrt.audio.framer*" "duplexrt.core.session*" "duplexrt.core.scheduler*" \
	"duplexrt.protocols.*"

mutation: install
	$(BIN)/python -m pip install --quiet 'mutmut==3.8.1'
	-NO_TORCH_COMPILE=1 timeout $(MUTATION_SECONDS) $(BIN)/mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	@$(BIN)/mutmut results --all true | sed -E 's/^ *(duplexrt[a-z_.]*)\.x[^:]*: (.*)$$/\1: \2/' \
		| sort | uniq -c

clean:
	rm -rf $(VENV) build *.egg-info mutants
