# One setup path for users and CI. `make test` = setup (fast when nothing changed) + ruff (format, lint) + mypy (typecheck) + pytest.
VENV ?= .venv
STAMP := $(VENV)/.rmsft-installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist): 0 runs every test in this process (needed for -s, --pdb); N runs N, each taking the
# suite's work units longest first (tests/suite_clock.py). Two by default: the cluster tier (a third of the suite)
# runs on one while the other takes the rest, which is what keeps `make test` inside CI's 90 minutes on 2 cores
# (docs/development.md, "Test time").
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder)

.PHONY: setup test lint typecheck protos crd clean gpu-check gpu-check-wheels test-reverse

setup: $(STAMP)

# A new ../shared/envtest archive (control-plane binaries for tests/envtest) re-runs setup too.
$(STAMP): pyproject.toml requirements/constraints.txt scripts/setup.sh scripts/setup-cluster.sh $(wildcard ../shared/envtest/k8s-*.tar.xz)
	bash scripts/setup.sh
	bash scripts/setup-cluster.sh
	touch $@

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# The type checker: every package rmsft ships (pyproject.toml [tool.mypy]: the paths, the pydantic plugin, the
# strict protocol modules) with no error. A few seconds with its cache (.mypy_cache).
typecheck: setup
	$(VENV)/bin/mypy --config-file pyproject.toml

# The envtest tier (tests/envtest) reads KUBEBUILDER_ASSETS; a caller's own value (setup-envtest) wins,
# else the binaries `make setup` unpacked into .tools/envtest/bin are used when they are there.
ENVTEST_BIN := $(CURDIR)/.tools/envtest/bin

test: lint typecheck
	if [ -z "$$KUBEBUILDER_ASSETS" ] && [ -x "$(ENVTEST_BIN)/kube-apiserver" ]; then \
	  export KUBEBUILDER_ASSETS="$(ENVTEST_BIN)"; fi; \
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(VENV)/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)

# Order independence: the operator and trainer tiers' tests in reverse order (about 3 minutes, one process).
test-reverse: setup
	PYTHONPATH=tests/plugins $(VENV)/bin/python -m pytest -p no:xdist -p reverse_order -q \
	  tests/operator tests/learner/test_trainer_fast.py tests/learner/test_objectives.py $(PYTEST_ARGS)

protos: setup
	$(VENV)/bin/python scripts/gen_protos.py

# The CRD and the spec reference page, both generated from rmsft/jobspec/ (tests fail when either is stale).
crd: setup
	$(VENV)/bin/python -m rmsft_operator.crd > charts/rmsft/crds/rolloutmatchingjobs.yaml
	$(VENV)/bin/python scripts/gen_spec_reference.py

# One command on an offline GPU host (scripts/gpu_check.py): the gpu tests, the step at real shapes, the memory
# plan beside the measured peaks, packed vs padded, offload, colocated HF-engine steps; a report in $$OUT or
# ./gpu-check. Runs with the host's python3 (its CUDA torch) unless PYTHON is given; needs no setup, no network.
PYTHON ?= python3
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# Beforehand, with network: the wheels such a host lacks (requirements/gpu-check-wheels.txt) into
# .gpu-check-wheels/, and the check that the tree plus that folder fit the 64 MiB a host takes.
gpu-check-wheels:
	$(PYTHON) scripts/gpu_check_wheels.py

clean:
	rm -rf $(VENV) .tools
