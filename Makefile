# Two commands on a fresh Linux machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The dev environment pins torch; pyproject.toml states the supported range.
# Packages are byte-compiled at install: where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines) nothing else writes .pyc files, and every process (test subprocesses,
# distributed ranks) would recompile torch's and sympy's sources on import (about 2x slower).
TORCH_PIN := torch==2.13.0
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,compare,clients]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m harness operators --case rbf-matmul --n 4096 --m 4096 --d 3 --channels 16 --backward --first-call --cache warm \
		--variants dense,generic,keops --output results/demo-rbf-matmul-first-call.json
	$(PY) -m harness operators --case rbf-matmul --n 4096 --m 4096 --d 3 --channels 16 --backward --repeats 3 --warmup 1 --output results/demo-rbf-matmul.json

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .cache results
