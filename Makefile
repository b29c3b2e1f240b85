# One setup path for users and CI. `make test` = setup (fast when nothing changed) + ruff + pytest.
VENV ?= .venv
STAMP := $(VENV)/.rmsft-installed
PYTEST_ARGS ?=

.PHONY: setup test lint protos clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	PATH="$(CURDIR)/.tools/bin:$$PATH" $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

protos: setup
	$(VENV)/bin/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .tools
