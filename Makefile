# Two commands for a newcomer (see README):
#   make lab    create/update .venv, install gpulab, open the lessons in JupyterLab
#   make test   create/update .venv, install gpulab with test extras, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gpulab-installed

.PHONY: lab test venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab lessons/

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV)
