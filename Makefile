# Quick start: `make demo` (install + run the demo), `make test` (install + run every check).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The gRPC handler contract's Python code: generated at install time, never committed.
PROTO_SRC := nemesis/proto/nemesis/v1/handler.proto
PROTO_OUT := nemesis/proto/nemesis/v1/handler_pb2.py

.PHONY: install proto demo run test test-fast system-packages lint typecheck pytest bench clean

install: $(VENV)/.installed $(PROTO_OUT)

proto: $(PROTO_OUT)

# Regenerated when the .proto changes or the venv is reinstalled (a new grpcio-tools).
$(PROTO_OUT): $(PROTO_SRC) $(VENV)/.installed
	$(BIN)/python -m nemesis.proto

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,speed]'
	touch $@

demo: install
	$(BIN)/nemesis demo

run: install
	$(BIN)/nemesis run  # ./nemesis.yaml when present (see nemesis.example.yaml), else the defaults

# The whole suite, in parallel over the cores (pytest-xdist; a module's cases stay on one
# worker, so a server a module starts is started once). Installs the Debian packages the
# tests need when they are missing.
test: install system-packages lint typecheck pytest

# The quick loop while editing: everything but the long end-to-end runs.
test-fast: install
	$(BIN)/pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

system-packages:
	.ci/system-packages

lint: install
	$(BIN)/ruff check nemesis dlq_viewer tests
	$(BIN)/ruff format --check nemesis dlq_viewer tests

typecheck: install
	$(BIN)/mypy

XDIST ?= -n auto --dist loadfile

# The 25 slowest tests are listed at the end of every run (where the time goes).
DURATIONS ?= --durations=25

pytest: install
	$(BIN)/pytest $(XDIST) $(DURATIONS) $(PYTEST_ARGS)

bench: install
	$(BIN)/python tests/bench/delivery.py --only delivery --only log --only latency --only kafka

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
	rm -f nemesis/proto/nemesis/v1/*_pb2.py nemesis/proto/nemesis/v1/*_pb2.pyi
