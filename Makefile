# The two set-up commands of the README: `make serve` and `make test`.
# The first of these that is Python 3.11 to 3.13 (3.11 first: this machine's CPU torch wheel is for it).
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3; do \
	$$p -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null && echo $$p && break; done)
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
ARGS ?=

.PHONY: install serve test test-fast lint fuzz test-containers protos docs clean

# Editing the C++ sources re-runs the install, which rebuilds them.
$(INSTALLED): pyproject.toml setup.py $(wildcard drafter_service/csrc/*) $(wildcard verifier_service/csrc/*)
	@test -n "$(PYTHON)" || { echo "speclane needs Python 3.11, 3.12 or 3.13 (python3.11 ... on PATH, or make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[all,test]'
	touch $@

install: $(INSTALLED)

serve: install
	$(BIN)/speclane serve $(ARGS)

# Everything CI runs, the slowest tests listed at the end.
# The model and the data set the in-process tests read (a test that starts no process cannot fetch them).
test: install
	$(BIN)/speclane pull smollm2-135m-instruct
	$(BIN)/speclane pull humaneval
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 $(ARGS)

# Unit and in-process tests only (no test that starts a process): a few minutes, for the edit loop.
test-fast: install
	$(BIN)/speclane pull smollm2-135m-instruct
	$(BIN)/speclane pull humaneval
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not e2e" $(ARGS)

lint: install
	$(BIN)/ruff check .

# The fuzz tests (tests/*/test_fuzz_*.py) with many more examples than `make test` runs, new ones
# on every run: FUZZ_EXAMPLES per test (~5 min at the default on 2 cores).
FUZZ_EXAMPLES ?= 2000
fuzz: install
	SPECLANE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -p no:cacheprovider \
		$(wildcard tests/*/test_fuzz_*.py) $(ARGS)

# Opt-in, slow (~5 min), needs root and podman: the single-host compose stack in real containers.
test-containers: install
	VENV=$(VENV) compose/container-test.sh

protos: install
	$(BIN)/python -m protos.build

# The flag reference is generated from the config dataclasses (tests/cli/test_reference.py checks it).
docs: install
	$(BIN)/python -m speclane_cli.reference > docs/reference/flags.md

clean:
	rm -rf $(VENV) build *.egg-info
