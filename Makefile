# The README's two commands: `make demo` and `make test`. Both create .venv when missing and are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch is pinned here; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.ditq-installed

.PHONY: demo test test-fast test-attacks lint typecheck install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test]' $(TORCH_PIN)
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check ditq tests benchmarks tools
	$(VENV)/bin/ruff format --check ditq tests benchmarks tools

typecheck: $(STAMP)
	$(VENV)/bin/mypy ditq

# Two workers, one per core; the slow-marked tests are scheduled first (tests/conftest.py). worksteal: a worker
# that runs out of tests takes half of what the other has left (xdist's default sends each worker a fixed first
# chunk, all the slow tests to one, and the other sat idle at the end).
test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest -q -n 2 --dist worksteal --durations=20 tests

# The same without the slow-marked end-to-end tests: a quick loop while changing code.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist worksteal -m "not slow" tests

# The project's adversarial suite: every hostile input of tests/adversarial/attack_inputs.py through the CLI, each
# classified clean, weak or defect; fails on any defect. CI runs it after `make test`; most cases run forked from
# one process that has imported torch and ditq once (tests/adversarial/fork_server.py; --fresh: a new process each,
# about three times as long). `make test` runs a slice of it (tests/adversarial/test_fast_slice.py).
ATTACKS_OUT ?= test-artifacts/attack_inputs.json
test-attacks: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) tests/adversarial/attack_inputs.py --fail-on-defects --out $(ATTACKS_OUT)

demo: $(STAMP)
	$(VENV)/bin/ditq demo --out demo-out
	@echo "ditq is $(VENV)/bin/ditq (or run: source $(VENV)/bin/activate)"

clean:
	rm -rf $(VENV) demo-out build *.egg-info
