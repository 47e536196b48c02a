# The two set-up commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
ARGS ?=

.PHONY: install serve test lint protos clean

# Editing the C++ drafter core re-runs the install, which rebuilds it.
$(INSTALLED): pyproject.toml setup.py $(wildcard drafter_service/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[all,test]'
	touch $@

install: $(INSTALLED)

serve: install
	$(BIN)/speclane serve $(ARGS)

test: install
	$(BIN)/speclane pull smollm2-135m-instruct
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)

lint: install
	$(BIN)/ruff check .

protos: install
	$(BIN)/python -m protos.build

clean:
	rm -rf $(VENV) build *.egg-info
