# Two commands do all the set-up on a fresh machine with Python 3.11 and pip:
#   make run    installs into .venv, then runs the main job: `duplexrt serve` (echo model, port 8000)
#   make test   installs into .venv (with test extras), then runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install clean mutation

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

# Mutation testing of the core modules (docs/mutation.md): a dev tool, outside CI and outside the
# test extras, installed here only.  Time-boxed: whatever is not done when MUTATION_SECONDS run
# out stays "not checked", and a later `make mutation` goes on from there (results are kept in
# mutants/).  MUTANTS picks the modules, as mutmut's name globs.
MUTATION_SECONDS ?= 3600
MUTATION_JOBS ?= 2
MUTANTS ?= "duplexrt.inbox*" "duplexrt.audio.framer*" "duplexrt.session*" "duplexrt.scheduler*" \
	"duplexrt.protocols.*"

mutation: install
	$(BIN)/python -m pip install --quiet 'mutmut==3.8.1'
	-NO_TORCH_COMPILE=1 timeout $(MUTATION_SECONDS) $(BIN)/mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	@$(BIN)/mutmut results --all true | sed -E 's/^ *(duplexrt[a-z_.]*)\.x[^:]*: (.*)$$/\1: \2/' \
		| sort | uniq -c

clean:
	rm -rf $(VENV) build *.egg-info mutants
