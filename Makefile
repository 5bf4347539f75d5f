# The commands a newcomer needs. Everything downloaded or built is cached outside the
# clone (pip's cache, $(CACHE) for Kafka's jars and the Kubernetes binaries).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CACHE ?= $(or $(VMSTREAM_CACHE_DIR),$(HOME)/.cache/vmstream)
export VMSTREAM_CACHE_DIR := $(CACHE)

.PHONY: help setup parts demo check test test-fast simulate bench schemas examples clean

help:
	@echo "make demo      the worker on a local Kafka with a realistic scenario"
	@echo "make check     mypy --strict and the import contracts (pyproject.toml)"
	@echo "make test      make check, then every test, against a real Kafka broker and kube-apiserver"
	@echo "make test-fast the pure rules and simulate only (no broker, no API server)"
	@echo "make bench     the benchmarks (they print figures)"

$(BIN)/vmstream: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

setup: $(BIN)/vmstream

# The real parts: Kafka's jars from Maven Central, kube-apiserver and etcd built from
# the Go module proxy, and KubeVirt's CRDs and examples generated from it (minutes the
# first time, then cached).
parts: setup
	$(BIN)/python -c "from harness.localkafka import resolve_jars; print(resolve_jars())"
	$(BIN)/python -c "from harness.localkube import ensure_binaries; print(ensure_binaries())"
	$(BIN)/python -c "from harness.locations import third_party_dir; print(third_party_dir())"

demo: parts
	$(BIN)/python -m harness demo

# Static checks, seconds: the types (mypy --strict) and the architecture (lint-imports: the
# rules import no I/O library, Faust only in the worker, the kubernetes client only at the
# Kubernetes edge and in the harness, the product never the harness). Both configured in
# pyproject.toml.
check: setup
	$(BIN)/mypy handlers streams harness
	$(BIN)/lint-imports

# check first: it fails in seconds, before the parts are fetched or any broker started.
test: check parts
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q tests/rules tests/test_simulate.py tests/test_schemas.py

simulate: setup
	$(BIN)/vmstream simulate --config examples/config.yaml --input examples/drain.jsonl

bench: setup
	$(BIN)/python benchmarks/simulate_throughput.py

schemas: setup
	$(BIN)/vmstream schemas --output docs/schemas

examples: setup
	$(BIN)/python examples/build.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
