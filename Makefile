# Two commands for a newcomer (see README):
#   make lab    create/update .venv with what the lessons need, open them in JupyterLab
#   make test   create/update .venv with the test tools too, run the default test suite
# and one for developers:
#   make quick  unit and panel tests only (no lesson execution, browser or Binder): a few minutes
#   make test-extended  what make test leaves out (the extension and homework lessons, headless and in
#          the browser; the rest of the exhaustive cross products): CI runs it after make test
#   make test-colab  the lessons headless plus the quick suite under Google Colab's versions
#          (colab/pins.txt), in their own .venv-colab: not part of `make test`
#   make test-claims-oldest  the PyTorch claim registry and the number scan on that oldest torch
#          (Colab's), in .venv-oldest: not part of `make test`
#
# Which PyTorch build goes into .venv (TORCH=auto, the default, decides by the machine):
#   cpu    PyTorch's CPU-only wheels from PyTorch's CPU index (about 1 GB in the venv): the choice
#          on a machine without an NVIDIA GPU (a laptop, a CPU server); the lessons use the cpu
#          and fake engines there
#   cuda   the registry's default build, with its CUDA libraries (about 6 GB): the choice when
#          `nvidia-smi -L` lists a GPU
# If PyTorch's CPU index cannot be reached, auto falls back to the default build and says so;
# TORCH=cpu insists on the CPU wheels, TORCH_CPU_INDEX=URL names a mirror of that index.
# The build is chosen when .venv is created: `make clean` first to change it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# extra arguments for `jupyter lab`, e.g. LAB_ARGS="--no-browser --port 8888" on a remote machine
LAB_ARGS ?=

# uv installs (fast, and it keeps every wheel it downloads in its cache, which the Binder test's
# rebuild then reuses). It is the installer, kept beside the environment, not inside it: the
# lessons' kernel cannot import it. A `uv` already on PATH is used as it is.
UV_HOME := $(VENV)/tools
UV      ?= $(shell command -v uv 2>/dev/null || echo $(UV_HOME)/bin/uv)

# stamps: the torch build, what the lessons need, what the tests need (each implies the one before)
TORCH_STAMP := $(VENV)/.gpulab-torch
LAB_STAMP   := $(VENV)/.gpulab-lab
TEST_STAMP  := $(VENV)/.gpulab-test

# Independent tests run in parallel, one worker per core (pytest-xdist). --dist loadgroup keeps
# each xdist_group (the Binder environment, the JupyterLab server) on one worker, so its
# module-scoped fixture is built once. The slowest tests are listed at the end.
PYTEST_PAR := -n auto --dist loadgroup --durations=20

.PHONY: lab test test-browser-all test-extended quick test-colab venv clean chromium

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gpulab needs Python 3.11 or newer; $(PYTHON) is " + sys.version.split()[0] + ". Run: make PYTHON=python3.11 (or python3.12, ...)")'
	$(PYTHON) -m venv $(VENV)

$(UV_HOME)/bin/uv: | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check --target $(UV_HOME) uv

# --compile-bytecode: every package is installed with its .pyc files. Without them a process that
# imports torch._dynamo (torch.compile, torchvision's ops, transformers' image utilities) compiles
# its sources again, about 6 s of CPU on a 2-core machine, whenever Python may not write its cache
# (PYTHONDONTWRITEBYTECODE=1, as on CI runners and in many containers).
$(TORCH_STAMP): | $(PY) $(if $(filter $(UV_HOME)/bin/uv,$(UV)),$(UV_HOME)/bin/uv)
	@build="$(TORCH)"; \
	if [ "$$build" = auto ]; then \
	  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then build=cuda; \
	  elif [ "$$(uname -s)" = Linux ]; then build=cpu; else build=cuda; fi; \
	fi; \
	case "$$build" in \
	  cpu) echo "gpulab: no NVIDIA GPU found: installing PyTorch's CPU-only build from $(TORCH_CPU_INDEX)"; \
	       if ! $(UV) pip install --compile-bytecode --python $(PY) --index-url $(TORCH_CPU_INDEX) torch torchvision; then \
	         if [ "$(TORCH)" = cpu ]; then echo "gpulab: could not install the CPU build from $(TORCH_CPU_INDEX)" >&2; exit 1; fi; \
	         echo "gpulab: PyTorch's CPU index could not be reached: installing the registry's default build instead (with CUDA libraries, about 6 GB). It runs on the CPU too. Set TORCH_CPU_INDEX=URL to use a mirror of the CPU index."; \
	         build=cuda; \
	         $(UV) pip install --compile-bytecode --python $(PY) torch torchvision || exit 1; \
	       fi ;; \
	  cuda) echo "gpulab: installing PyTorch's default build (with CUDA libraries)"; \
	        $(UV) pip install --compile-bytecode --python $(PY) torch torchvision || exit 1 ;; \
	  *) echo "TORCH must be auto, cpu or cuda (got '$$build')" >&2; exit 2 ;; \
	esac; \
	echo "$$build" > $@

$(LAB_STAMP): pyproject.toml $(TORCH_STAMP)
	$(UV) pip install --compile-bytecode --python $(PY) -e .
	touch $@

$(TEST_STAMP): pyproject.toml $(LAB_STAMP)
	$(UV) pip install --compile-bytecode --python $(PY) -e '.[test]'
	$(UV) pip install --compile-bytecode --python $(PY) --no-deps torchtitan==0.3.0
	touch $@

venv: $(LAB_STAMP)

# Jupyter refuses to start as root unless told; root is the normal user in Docker, RunPod or
# Vast containers, so there it is told, and says so.
lab: $(LAB_STAMP)
	@if [ "$$(id -u)" = 0 ]; then echo "gpulab: running as root (as in a container): starting JupyterLab with --allow-root"; fi
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS) lessons/

# make test runs the browser test on the one-day workshop's lessons (docs/teaching.md's day table);
# test-browser-all runs every lesson's every cell in JupyterLab in Chromium, the homework lessons too
# test-extended runs what make test leaves out: those lessons in the browser and the rest of the
# exhaustive cross products (marked extended); CI (.ci/run) runs it after make test
test: $(TEST_STAMP) chromium
	$(PY) -m pytest $(PYTEST_PAR) -m "not browser_all and not extended and not site"

test-browser-all: $(TEST_STAMP) chromium
	$(PY) -m pytest $(PYTEST_PAR) -m browser tests/test_browser.py

test-extended: $(TEST_STAMP) chromium
	$(PY) -m pytest $(PYTEST_PAR) -m "browser_all or extended"

quick: $(TEST_STAMP)
	$(PY) -m pytest $(PYTEST_PAR) -m "not notebook and not slow and not browser"

# Google Colab's runtime, pinned (issue #37): colab/pins.txt holds the versions Colab ships
# (torch, torchvision, transformers, ipywidgets 7, numpy, ...; its header names the source).
# .venv-colab gets them on Colab's Python (COLAB_PYTHON), torch and torchvision from PyTorch's
# CPU index when it answers (else the registry's default build), then gpulab and its test tools
# with those versions as overrides (so they are tested even where gpulab's floors ask for more).
# test-colab runs the lessons headless and the quick suite there, then checks with pip's dry run
# that the lessons' Colab install line would download no torch, torchvision, transformers or
# ipywidgets (gpulab's floors are Colab's versions, which this target tests).
# Not in `make test`: a second torch and the lessons again (CI time).
COLAB_VENV   ?= .venv-colab
COLAB_PYTHON ?= python3.13
COLAB_PY     := $(COLAB_VENV)/bin/python
COLAB_PINS   := colab/pins.txt
COLAB_STAMP  := $(COLAB_VENV)/.gpulab-colab

$(COLAB_STAMP): $(COLAB_PINS) pyproject.toml | $(if $(filter $(UV_HOME)/bin/uv,$(UV)),$(UV_HOME)/bin/uv)
	test -x $(COLAB_PY) || $(UV) venv --python $(COLAB_PYTHON) $(COLAB_VENV)
	$(UV) pip install --compile-bytecode --python $(COLAB_PY) --index-url $(TORCH_CPU_INDEX) \
	    -c $(COLAB_PINS) torch torchvision \
	  || { echo "gpulab: PyTorch's CPU index could not be reached: Colab's torch from the registry's default build"; \
	       $(UV) pip install --compile-bytecode --python $(COLAB_PY) -c $(COLAB_PINS) torch torchvision; }
	$(UV) pip install --compile-bytecode --python $(COLAB_PY) --overrides $(COLAB_PINS) -e '.[test]' pip
	touch $@

test-colab: $(COLAB_STAMP)
	$(COLAB_PY) -m pytest $(PYTEST_PAR) -m "not slow and not browser" tests/test_robustness.py tests/test_colab.py -p no:cacheprovider
	$(COLAB_PY) -m pytest $(PYTEST_PAR) -m "not notebook and not slow and not browser" -p no:cacheprovider
	@keep="torch==$$($(COLAB_PY) -c 'import importlib.metadata as m; print(m.version("torch"))') torchvision==$$($(COLAB_PY) -c 'import importlib.metadata as m; print(m.version("torchvision"))')"; \
	out=$$($(COLAB_PY) -m pip install --dry-run --disable-pip-version-check "gpulab @ file://$(CURDIR)" $$keep 2>&1) \
	  || { echo "$$out"; echo "gpulab: pip cannot install gpulab beside Colab's $$keep" >&2; exit 1; }; \
	echo "$$out" | grep '^Would install' || echo "pip would install nothing new"; \
	if echo "$$out" | grep '^Would install' | grep -qiE ' (torch|torchvision|transformers|ipywidgets)-[0-9]'; then \
	  echo "gpulab: the Colab install line would replace one of Colab's torch, torchvision, transformers, ipywidgets" >&2; exit 1; fi

# The claim registry and the number scan on the oldest torch the lessons support (issue 47: they run
# on Colab's torch, colab/pins.txt's, through the newest). .venv-oldest gets that torch on gpulab's
# oldest Python (OLDEST_PYTHON), the registry's default build (a CUDA build, about 4 GB: its
# libraries hold the C++ names tests/test_pytorch_claims.py looks for; a CPU-only build would skip
# those checks), and only what these tests import; test-claims-oldest runs the claim registry, the
# number scan and the docs test there. Not in `make test`: it downloads a second torch.
OLDEST_VENV   ?= .venv-oldest
OLDEST_PYTHON ?= python3.11
OLDEST_PY     := $(OLDEST_VENV)/bin/python
OLDEST_STAMP  := $(OLDEST_VENV)/.gpulab-oldest
OLDEST_TESTS  := tests/test_pytorch_claims.py tests/test_typed_numbers.py tests/test_docs.py
.PHONY: test-claims-oldest

$(OLDEST_STAMP): $(COLAB_PINS) pyproject.toml | $(if $(filter $(UV_HOME)/bin/uv,$(UV)),$(UV_HOME)/bin/uv)
	test -x $(OLDEST_PY) || $(UV) venv --python $(OLDEST_PYTHON) $(OLDEST_VENV)
	$(UV) pip install --compile-bytecode --python $(OLDEST_PY) -c $(COLAB_PINS) torch \
	    'pytest>=8,<9.1' 'pytest-timeout>=2.3' 'nbformat>=5.9' numpy
	$(UV) pip install --compile-bytecode --python $(OLDEST_PY) --no-deps -e .
	touch $@

test-claims-oldest: $(OLDEST_STAMP)
	@$(OLDEST_PY) -c 'import torch; print("gpulab: torch", torch.__version__)'
	$(OLDEST_PY) -m pytest -p no:cacheprovider -q $(OLDEST_TESTS)

# the browser test (tests/test_browser.py) drives Debian's chromium; install it when missing
chromium:
	@command -v chromium >/dev/null || test -x /usr/bin/chromium || \
	  { if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; \
	    else echo "chromium missing and no root/sudo: the browser test will skip"; exit 0; fi; \
	    $$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y chromium \
	    || echo "could not install chromium: the browser test will skip"; }

# The course site (issue 44, docs/site.md): `make site` builds the lessons, executed on the CPU
# (cached in build/site/jupyter_cache: a rebuild runs only lessons whose code changed), and
# docs/*.md, with the README as the landing page, into build/site/html (Sphinx, myst-nb and
# sphinx-book-theme: the `site` extra), from a copy in build/site/src (Sphinx sees the README as
# index.md beside lessons/ and docs/). SITE_LESSONS=00,07 builds only those lessons. The
# ipywidgets renderer (@jupyter-widgets/html-manager's embed.js) comes from the npm registry, so
# that no page loads a script from a CDN; without npm the widgets show as text.
# `make test-site` builds the site, then checks it in headless Chromium (tests/test_site.py).
SITE_STAMP   := $(VENV)/.gpulab-site
SITE_DIR     := build/site
SITE_LESSONS ?=
HTML_MANAGER ?= 1.0.15
SITE_WIDGETS := $(SITE_DIR)/vendor/static/widgets/embed.js
.PHONY: site test-site

$(SITE_STAMP): pyproject.toml $(LAB_STAMP)
	$(UV) pip install --compile-bytecode --python $(PY) -e '.[site]'
	touch $@

$(SITE_WIDGETS):
	@if ! command -v npm >/dev/null; then echo "gpulab: npm not found: the site shows widgets as text"; exit 0; fi; \
	rm -rf $(SITE_DIR)/vendor/npm && mkdir -p $(SITE_DIR)/vendor/npm $(@D) && \
	( cd $(SITE_DIR)/vendor/npm && npm pack --silent @jupyter-widgets/html-manager@$(HTML_MANAGER) >/dev/null && \
	  tar xzf jupyter-widgets-html-manager-$(HTML_MANAGER).tgz ) && \
	find $(SITE_DIR)/vendor/npm/package/dist -maxdepth 1 -type f ! -name '*.map' ! -name '*amd.js' -exec cp {} $(@D)/ \; && \
	cp $(SITE_DIR)/vendor/npm/package/LICENSE $(@D)/ 2>/dev/null; test -f $@

# jupyter-cache keys a lesson's saved outputs on its code cells alone, so a change to the library
# that made them would leave them stale: any newer file under gpulab/ (or pyproject.toml) clears it
SITE_LIBRARY := $(SITE_DIR)/.library-stamp
$(SITE_LIBRARY): pyproject.toml $(shell find gpulab -name '*.py' -o -name '*.json' 2>/dev/null)
	rm -rf $(SITE_DIR)/jupyter_cache && mkdir -p $(@D) && touch $@

site: $(SITE_STAMP) $(SITE_WIDGETS) $(SITE_LIBRARY)
	rm -rf $(SITE_DIR)/src $(SITE_DIR)/html/reports && mkdir -p $(SITE_DIR)/src/lessons
	cp -p README.md $(SITE_DIR)/src/index.md
	cp -p lessons/*.ipynb $(SITE_DIR)/src/lessons/
	cp -pr docs site/assets $(SITE_DIR)/src/
	mv $(SITE_DIR)/src/assets $(SITE_DIR)/src/_assets
	SITE_LESSONS='$(SITE_LESSONS)' $(PY) -m sphinx -b html -E -c site -d $(SITE_DIR)/doctrees \
	  $(SITE_DIR)/src $(SITE_DIR)/html
	@echo "gpulab: the site is in $(SITE_DIR)/html (index.html); serve it with" \
	  "'$(PY) -m http.server -d $(SITE_DIR)/html -b 127.0.0.1 8000'"

test-site: site $(TEST_STAMP) chromium
	SITE_LESSONS='$(SITE_LESSONS)' $(PY) -m pytest -m site tests/test_site.py -p no:cacheprovider

clean:
	rm -rf $(VENV)
