# Quick start: `make demo` (install + run the demo), `make test` (install + run every check).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo run test lint typecheck pytest bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,speed]'
	touch $@

demo: install
	$(BIN)/nemesis demo

run: install
	$(BIN)/nemesis run -c nemesis.yaml

test: install lint typecheck pytest

lint: install
	$(BIN)/ruff check nemesis dlq_viewer tests bench
	$(BIN)/ruff format --check nemesis dlq_viewer tests bench

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/pytest $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/delivery.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
