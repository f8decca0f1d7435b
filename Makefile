# Two commands do all set-up on a fresh machine with only Python >= 3.11:
#   make run    trains LeNet-5 on the bundled digits and prints what it did
#   make test   runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lint bench clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "taskrt needs Python >= 3.11, found " + sys.version.split()[0]'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

run: $(VENV)/.installed
	$(PY) -m taskrt run

test: $(VENV)/.installed
	$(PY) -m ruff check taskrt ops search bench tests
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m taskrt.bench all --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
