# The two commands a new user needs:  `make lab`  and  `make test`.
# The course runs on Python 3.11, 3.12 and 3.13: the first of these found that runs is used, or
# PYTHON=/path/to/python3.x picks one (run with one of them when none is found).
SUPPORTED_PYTHONS := python3.11 python3.12 python3.13 python3
supported = import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))
ifeq ($(origin PYTHON),undefined)
PYTHON := $(firstword $(foreach p,$(SUPPORTED_PYTHONS),$(shell $(p) -c '$(supported)' >/dev/null 2>&1 && echo $(p))))
endif
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dtcourse-installed
# Notebooks call `!torchrun` and `jupyter`: find the venv's copies first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup lab lab-instructor notebook test site stress exercises bench gpu-check clean

setup: $(STAMP)

# setuptools (84.2 in pip's isolated build environment here) warns on every editable install of a flat
# layout that a folder named like the package could shadow it; here that folder is the package itself.
QUIET_EDITABLE := ignore::UserWarning:setuptools.command.editable_wheel

# Which torch build: PyPI's torch for Linux is the CUDA build (the venv took 5.1 GB with it on Python 3.12
# here). TORCH_PIN, the version the course's figures were measured with, goes in first; the rest then keeps
# it (pyproject.toml accepts the range that passed make test). On a laptop without an NVIDIA GPU,
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes it from PyTorch's CPU index (a 190 MB wheel).
# KEEP_TORCH=1 keeps the torch that PYTHON already has (a cluster's own build): the venv sees PYTHON's
# packages, and pip installs a torch only when that one is outside pyproject.toml's range.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
KEEP_TORCH ?=

# Re-installs only when the pins change. One thread per process keeps the
# 2-core CI machine from oversubscribing while several ranks run.
$(STAMP): pyproject.toml
	@test -x $(PY) || { test -n "$(PYTHON)" && $(PYTHON) -c '$(supported)'; } || { \
		echo "dtcourse needs Python 3.11, 3.12 or 3.13: $(if $(PYTHON),$(PYTHON) is not one of them (or does not run),none of $(SUPPORTED_PYTHONS) on the PATH is)."; \
		echo "Install one (python.org, your package manager, pyenv or conda), or name it: make PYTHON=/path/to/python3.12"; \
		exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(if $(KEEP_TORCH),--system-site-packages )$(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(KEEP_TORCH),,$(PY) -m pip install --quiet '$(TORCH_PIN)' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),))
	PYTHONWARNINGS=$(QUIET_EDITABLE) $(PY) -m pip install --quiet -e '.[dev]'
	@# a kept torch's torchrun is its Python's, outside the venv: the lessons' !torchrun needs the venv's Python
	@test -e $(VENV)/bin/torchrun || { printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -m torch.distributed.run "$$@"\n' \
		> $(VENV)/bin/torchrun && chmod +x $(VENV)/bin/torchrun; }
	@$(PY) -c 'import torch; print(f"dtcourse: torch {torch.__version__} in $(VENV)")'
	@touch $(STAMP)

# JupyterLab serves the whole course (lessons/, exercises/, solutions/) and opens the first
# lesson. OMP_NUM_THREADS=1 gives single-process cells the thread setting the tests use, and the
# PATH exported above puts `dtcourse` and `torchrun` in notebooks and JupyterLab's terminals.
# .jupyter/ (see its README) turns off the news pop-up, and nbgrader's instructor tools for
# students; `make lab-instructor` keeps those tools. --allow-root only when run as root (CI boxes).
LAB = OMP_NUM_THREADS=1 $(VENV)/bin/jupyter lab --ServerApp.root_dir=. \
      --LabApp.default_url=/lab/tree/lessons/00_memory.ipynb $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	JUPYTER_CONFIG_PATH=$(CURDIR)/.jupyter/student:$(CURDIR)/.jupyter/course $(LAB)

lab-instructor: setup
	JUPYTER_CONFIG_PATH=$(CURDIR)/.jupyter/course $(LAB)

# The same course in Jupyter Notebook 7, for students who prefer its one-document view (every lesson
# ran and every widget responded there under headless Chromium: tests/browser_check.py).
notebook: setup
	JUPYTER_CONFIG_PATH=$(CURDIR)/.jupyter/student:$(CURDIR)/.jupyter/course OMP_NUM_THREADS=1 \
	$(VENV)/bin/jupyter notebook --ServerApp.root_dir=. \
	--JupyterNotebookApp.default_url=/notebooks/lessons/00_memory.ipynb $(if $(filter 0,$(shell id -u)),--allow-root,)

# The lessons run while tests/busy.py keeps every core busy: their live measurements must
# survive a student's loaded laptop. The solutions run on a quiet machine.
NBVAL = --nbval-lax --nbval-current-env --nbval-cell-timeout=300 -p no:randomly

# $(call workers,N,MODE): pytest-xdist's options for N workers dealing out tests by MODE; none for N = 1.
workers = $(if $(filter-out 1,$(1)),-n $(1) --dist $(2),)

# The test files run on TEST_JOBS workers, each file whole on one worker (loadfile: a module's fixtures
# run once). Most tests wait for ranks, kernels or torchrun to start, so one worker keeps about one core
# busy; two took 359 s where one took 572 s on the 2-core box. TEST_JOBS=1: one after another.
TEST_JOBS ?= 2

test: setup
	@$(PY) -m dtcourse.exercises --check
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(call workers,$(TEST_JOBS),loadfile) tests
	OMP_NUM_THREADS=1 $(PY) tests/busy.py -- $(PY) -m pytest -q $(NBVAL) lessons
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(NBVAL) solutions

# The course as a static web site in site/: every lesson executed here, one HTML page each with its outputs
# and figures, widgets as their pictures, and site/index.html listing the lessons in order (dtcourse/site.py
# says how and why nbconvert). Not part of make test: it runs every lesson once more.
site: setup
	$(PY) -m dtcourse.site --out site

# Every lesson STRESS_RUNS times beside two busy processes per core (twice make test's load), with the
# failing cells counted per lesson; run by hand (about 35 minutes on the 2-core box), not by CI.
STRESS_RUNS ?= 10
stress: setup
	$(PY) tests/stress_lessons.py --runs $(STRESS_RUNS) --logs /tmp/dtcourse-stress

# Regenerate the student notebooks from solutions/ (needs no nbgrader).
exercises:
	@$(if $(wildcard $(PY)),$(PY),python3) -m dtcourse.exercises

# Every benchmark but the GPU one (gpu-check runs that).
bench: setup
	for stem in $$($(VENV)/bin/dtcourse bench --list | sed 's/^benchmarks: //; s/,//g; s/\bgpu\b//'); do \
		OMP_NUM_THREADS=1 $(VENV)/bin/dtcourse bench $$stem || exit 1; done

# On a machine with an NVIDIA GPU: the GPU benchmarks (dtcourse/bench/gpu.py), then the whole test
# suite (its CUDA tests run instead of skipping) and every notebook. GPU_PY=python3 uses a Python that
# already has a CUDA build of torch instead of the venv; JOBS>1 needs pytest-xdist there.
GPU_PY ?= $(PY)
JOBS   ?= 1
gpu-check: $(if $(filter $(PY),$(GPU_PY)),setup,)
	$(GPU_PY) -m dtcourse.bench.gpu
	OMP_NUM_THREADS=1 $(GPU_PY) -m pytest -q -rf $(call workers,$(JOBS),loadfile) tests
	OMP_NUM_THREADS=1 $(GPU_PY) -m pytest -q -rf $(call workers,$(JOBS),loadscope) $(NBVAL) lessons solutions

clean:
	rm -rf $(VENV) .pytest_cache
