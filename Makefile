# `make demo` and `make test` each work on a fresh machine: they build .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch: the CPU build, asked for by exact version (a bare "torch" pulls a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,torch]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuscale demo --out reports/demo

test: $(STAMP)
	$(BIN)/ruff check predictor scaler tests
	$(BIN)/bandit -q -c pyproject.toml -r predictor scaler
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q
	$(BIN)/python -m pytest -q -ra

lint: $(STAMP)
	$(BIN)/ruff check predictor scaler tests
	$(BIN)/ruff format --check predictor scaler tests

clean:
	rm -rf $(VENV) reports .pytest_cache site
