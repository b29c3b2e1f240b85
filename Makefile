# One setup path for users and CI. `make test` = setup (fast when nothing changed) + ruff + pytest.
VENV ?= .venv
STAMP := $(VENV)/.rmsft-installed
PYTEST_ARGS ?=

.PHONY: setup test lint protos crd clean

setup: $(STAMP)

# A new ../shared/envtest archive (control-plane binaries for tests/envtest) re-runs setup too.
$(STAMP): pyproject.toml requirements/constraints.txt scripts/setup.sh scripts/setup-cluster.sh $(wildcard ../shared/envtest/k8s-*.tar.xz)
	bash scripts/setup.sh
	bash scripts/setup-cluster.sh
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

# The envtest tier (tests/envtest) reads KUBEBUILDER_ASSETS; a caller's own value (setup-envtest) wins,
# else the binaries `make setup` unpacked into .tools/envtest/bin are used when they are there.
ENVTEST_BIN := $(CURDIR)/.tools/envtest/bin

test: lint
	if [ -z "$$KUBEBUILDER_ASSETS" ] && [ -x "$(ENVTEST_BIN)/kube-apiserver" ]; then \
	  export KUBEBUILDER_ASSETS="$(ENVTEST_BIN)"; fi; \
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

protos: setup
	$(VENV)/bin/python scripts/gen_protos.py

# The CRD and the spec reference page, both generated from rmsft/jobspec.py (tests fail when either is stale).
crd: setup
	$(VENV)/bin/python -m rmsft_operator.crd > charts/rmsft/crds/rolloutmatchingjobs.yaml
	$(VENV)/bin/python scripts/gen_spec_reference.py

clean:
	rm -rf $(VENV) .tools
