# tokenmill: `make demo` runs the main job on the bundled sample corpus, `make test` runs the tests.
# Both install what they need into .venv first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export XLA_FLAGS ?=
export PYTHONHASHSEED := 0

.PHONY: install demo swarm test test-slow test-install test-all bench lint sample browser clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,train]'
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: install
	TOKENMILL=$(BIN)/tokenmill PYTHON=$(BIN)/python bash scripts/demo.sh

# Mixture search on the demo corpus (scripts/swarm.sh, docs/search.md): 32 tiny proxies, their fit, a
# proposed mixture, its validation against the prior and uniform mixtures, the swarm page. Resumable.
swarm: install
	TOKENMILL=$(BIN)/tokenmill PYTHON=$(BIN)/python bash scripts/swarm.sh

# Headless Chromium for the page tests (Debian packages; needs root or sudo on a fresh machine).
browser:
	@bash scripts/install_browser.sh

# One pytest worker per core (at most 4), a test file's tests on one worker so its module fixtures are made once.
PARALLEL := -n auto --maxprocesses 4 --dist loadfile

test: install browser
	$(BIN)/python -m pytest -m "not slow" -q $(PARALLEL)

test-slow: install browser
	$(BIN)/python -m pytest -m slow -q $(PARALLEL)

# A new virtual environment with `pip install .` alone (no extras) curates the sample with every shipped
# recipe, and a worker's install of the shipped wheel curates too (tests/test_clean_install.py; minutes).
test-install: install
	$(BIN)/python -m pytest -m install -q tests/test_clean_install.py

test-all: install browser
	$(BIN)/python -m pytest -q $(PARALLEL)

bench: install
	$(BIN)/python scripts/run_benchmarks.py

lint: install
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts

sample: install
	$(BIN)/python scripts/make_sample_corpus.py --output data/sample

clean:
	rm -rf out runs site .pytest_cache
