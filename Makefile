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

# torch 2.13.0 first: on these machines it is a local CPU build; an unpinned request would pull
# a multi-GB CUDA build.  The package itself keeps torch>=2.4 open for users.
# The moshi package pins torch<2.10 and numpy<2.3 but runs fine beside torch 2.13 and numpy 2.x:
# for the tests it goes in without its pins, with the light dependencies it really uses.
MOSHI_DEPS := 'safetensors>=0.4,<0.8' 'huggingface-hub>=0.24,<1.0' 'einops>=0.7,<0.9' \
	'sentencepiece>=0.2,<0.3' 'tqdm>=4.48'

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps moshi==0.2.13
	$(BIN)/python -m pip install --quiet $(MOSHI_DEPS)
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/duplexrt serve

test: install
	NO_TORCH_COMPILE=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
