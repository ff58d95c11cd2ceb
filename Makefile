# BigFleet developer entry points. `make install` then `make test` is all CI runs.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROTO_DIR := proto
GEN_DIR   := src/bigfleet/v1alpha1

.PHONY: install browser-deps proto proto-check lint typecheck test test-fast test-topology test-heavy bench fuzz soak e2e scale clean helm-check sync-crds

install: $(BIN)/bigfleet browser-deps

# Debian's chromium for the dashboard's browser test. Best effort: skipped (the test then skips,
# saying why) where apt-get is missing or we are not root; never downloads a browser build.
browser-deps:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "browser-deps: could not install chromium; the dashboard browser test will skip"; \
	else echo "browser-deps: no apt-get/root; the dashboard browser test will skip"; fi

# One resolve for both the package and the AWS provider (editable, with its test extra moto[server]).
$(BIN)/bigfleet: pyproject.toml providers/aws/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' -e './providers/aws[test]'
	@touch $@

# Regenerate messages, gRPC stubs and type stubs from proto/ into one package.
proto:
	$(BIN)/python -m bigfleet.tools.protogen

# Fails when the committed generated code differs from what `make proto` makes.
proto-check:
	$(BIN)/python -m bigfleet.tools.protocheck

lint:
	$(BIN)/ruff check src tests bench providers
	$(BIN)/lint-imports

typecheck:
	$(BIN)/mypy
	$(BIN)/mypy providers/aws/src/bigfleet_provider_aws

test: lint typecheck proto-check
	$(BIN)/pytest -q -p no:cacheprovider --durations=25

test-fast:
	$(BIN)/pytest -q -x -m 'not slow'

# The Helm chart's topology as real processes (3 coordinators, 2 shards x 3 replicas, one provider):
# the full scenario, with leader kill -9 / SIGSTOP and a cluster move (make test runs a slice).
test-topology:
	BIGFLEET_TOPOLOGY_FULL=1 $(BIN)/pytest -q -m topology

# Long real-process variants kept out of make test (a faster test there covers each one's behaviour).
test-heavy:
	$(BIN)/pytest -q -p no:cacheprovider -m heavy

bench:
	$(BIN)/python -m bench

# Lint, render and schema-check every Helm chart with its defaults and each ci/*.yaml (pytest runs
# the same checks in tests/deploy).
helm-check:
	$(BIN)/python tests/deploy/chartcheck.py

# Copy the operator's CRDs into the operator chart (a test fails while the two differ).
sync-crds:
	cp deploy/crds/*.yaml deploy/helm/bigfleet-operator/crds/

fuzz:
	$(BIN)/python -m bigfleet.tools.fuzz --seconds $${FUZZ_SECONDS:-60}

soak:
	$(BIN)/pytest -q -m soak

# The whole fleet as real processes with faults; the operator cut-off lasts the full 30 s here
# (make test runs the same test with a shorter cut-off). Recovery times: docs/perf/e2e.md.
e2e:
	BIGFLEET_E2E_CUTOFF=30 $(BIN)/pytest -q -s -p no:cacheprovider tests/e2e

# The scale harness with real daemons (sizes are flags: `make scale SCALE_ARGS="--clusters 5000 ..."`).
# Figures and commands: docs/perf/scale.md.
SCALE_ARGS ?= --shape aggregated --clusters 1000 --machines 100000 --interval 10 --warmup 20 --duration 30
scale:
	$(BIN)/bigfleet scaletest $(SCALE_ARGS) --json scale-report.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
