# The two commands a new user needs:  `make lab`  and  `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dtcourse-installed
# Notebooks call `!torchrun` and `jupyter`: find the venv's copies first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup lab test exercises bench clean

setup: $(STAMP)

# Re-installs only when the pins change. One thread per process keeps the
# 2-core CI machine from oversubscribing while several ranks run.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# --allow-root only when run as root (containers, CI boxes); ordinary users don't need it.
lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=. $(if $(filter 0,$(shell id -u)),--allow-root,) lessons/

test: setup
	@$(PY) -m dtcourse.exercises --check
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=300 -p no:randomly lessons solutions

# Regenerate the student notebooks from solutions/ (needs no nbgrader).
exercises:
	@$(if $(wildcard $(PY)),$(PY),python3) -m dtcourse.exercises

bench: setup
	OMP_NUM_THREADS=1 $(PY) -m dtcourse.bench.launch
	OMP_NUM_THREADS=1 $(PY) -m dtcourse.bench.collectives
	OMP_NUM_THREADS=1 $(PY) -m dtcourse.bench.data_parallel
	OMP_NUM_THREADS=1 $(PY) -m dtcourse.bench.parameter_server
	OMP_NUM_THREADS=1 $(PY) -m dtcourse.bench.checkpointing

clean:
	rm -rf $(VENV) .pytest_cache
