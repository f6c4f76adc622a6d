# Two commands for a newcomer (see README):
#   make lab    create/update .venv, install gpulab, open the lessons in JupyterLab
#   make test   create/update .venv, install gpulab with test extras, run the whole test suite
# and one for developers:
#   make quick  unit and panel tests only (no lesson execution, browser or Binder): a few minutes
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gpulab-installed

# Independent tests run in parallel, one worker per core (pytest-xdist). --dist loadgroup keeps
# each xdist_group (the Binder environment, the JupyterLab server) on one worker, so its
# module-scoped fixture is built once. The slowest tests are listed at the end.
PYTEST_PAR := -n auto --dist loadgroup --durations=20

.PHONY: lab test quick venv clean chromium

# uv installs (it keeps every wheel it downloads in its cache, which the Binder test's rebuild
# then reuses); pip only installs uv itself.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip uv
	$(VENV)/bin/uv pip install --python $(PY) -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab lessons/

test: $(STAMP) chromium
	$(PY) -m pytest $(PYTEST_PAR)

quick: $(STAMP)
	$(PY) -m pytest $(PYTEST_PAR) -m "not notebook and not slow and not browser"

# the browser test (tests/test_browser.py) drives Debian's chromium; install it when missing
chromium:
	@command -v chromium >/dev/null || test -x /usr/bin/chromium || \
	  { if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; \
	    else echo "chromium missing and no root/sudo: the browser test will skip"; exit 0; fi; \
	    $$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y chromium \
	    || echo "could not install chromium: the browser test will skip"; }

clean:
	rm -rf $(VENV)
