# Two targets for newcomers: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; without a pin pip takes a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test lint bench clean redis

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test,metrics,dev]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/p2pkv-node demo

# The cluster tests start a real redis-server on a free port. Install Debian's when it
# is missing and we are root (CI); otherwise say so, and those tests skip with the reason.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server (apt-get)"; \
	    apt-get install -y -q redis-server >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }; \
	  else \
	    echo "redis-server not installed and not root: the cluster tests will skip"; \
	  fi; }

test: venv redis
	$(PY) -m pytest -q
	$(VENV)/bin/ruff check p2pkv tests examples tools
	$(VENV)/bin/mypy

lint: venv
	$(VENV)/bin/ruff check p2pkv tests examples tools
	$(VENV)/bin/mypy

bench: venv
	$(VENV)/bin/p2pkv-node bench

clean:
	rm -rf $(VENV) build *.egg-info
