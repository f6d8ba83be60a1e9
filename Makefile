# Two entry points for a fresh machine (Python 3.10+, no GPU needed):
#   make demo   train, checkpoint with nvdcp, resume at another world size, verify
#   make test   install everything into .venv and run the test suite
#   make lint   ruff and mypy (CI runs it too)
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0's CPU wheel; on a GPU machine install your CUDA build of torch first.
TORCH ?= torch==2.13.0

# The last step adds torchtitan's checkpoint manager and config system for tests/integrations
# (its full dependency set conflicts with the s3 extra's fsspec pin: see pyproject.toml); 3.11+ only.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,s3,cli,lint]"
	$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' && $(PY) -m pip install -q --no-deps \
		torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 \
		|| echo "torchtitan not installed: tests/integrations will skip"
	touch $@

.PHONY: install demo test lint
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m nvdcp.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

# ruff (pyflakes, import order, bugbear, pyupgrade) over the whole tree, mypy over the package.
lint: $(VENV)/.installed
	$(PY) -m ruff check nvdcp tests benchmarks
	$(PY) -m mypy nvdcp
