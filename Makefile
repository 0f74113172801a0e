# labsupport workbook. `make` alone lists the targets.
# GNU make. Recipes below are indented with tabs.

.DEFAULT_GOAL := help
SHELL := /bin/bash

# The one place torch is pinned. It is installed before the package, whose own range
# (pyproject.toml: torch>=2.4,<3) admits it, so pip pulls no other torch build.
TORCH_PIN := torch==2.13.0
# Optional index for the torch wheel, e.g. https://download.pytorch.org/whl/cpu on a laptop
# that should not download the CUDA build: make lab TORCH_INDEX=...
TORCH_INDEX ?=

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# What .venv holds, one stamp per step, each on top of the one before: pip and the pinned torch;
# DeepSpeed, built against that torch; the package with [lab] (all that `make lab` needs); the
# test tools, [dev]. So `make test` after `make lab` only adds the test tools.
TORCH_STAMP := $(VENV)/.torch
DEEPSPEED_STAMP := $(VENV)/.deepspeed
LAB_STAMP := $(VENV)/.lab
DEV_STAMP := $(VENV)/.dev
RUNS := $(CURDIR)/runs
CHROMIUM := /usr/bin/chromium
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
# The attendee's copy of the notebooks, which `make lab` serves (git-ignored).
WORK := work
# The copy comes without the stored outputs, so that no prediction is answered and no bug lab
# solved before the attendee runs the cell. OUTPUTS=keep copies them as stored (an instructor's copy).
OUTPUTS ?= clear

# JupyterLab listens on this address only; add options with LAB_ARGS="--port=8899 --no-browser".
LAB_IP ?= 127.0.0.1
LAB_ARGS ?=
# Extra pytest options, e.g. make test PYTEST_ARGS="-k collectives -x"
PYTEST_ARGS ?=
# make test runs the files on this many pytest-xdist workers, a file (a notebook: its cells, in
# order, in one kernel) on one worker. Since ranks, agents and pool engines are forked (no interpreter
# importing torch per process), the tests wait more than they compute: on a 2-core machine three
# workers took 1103 s where two took 1276 s (the same suite; the two-worker run shared the machine with
# another job for part of its time). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 3

# Environment of test and notebook runs: run directories go to runs/ (git-ignored).
# MPLBACKEND is deliberately not set to Agg here: ipykernel only selects the inline backend
# when MPLBACKEND is unset, so Agg would strip every figure from executed notebooks.
# Headless pytest processes fall back to Agg on their own.
RUN_ENV := LABSUPPORT_RUNS="$(RUNS)"

.PHONY: help venv browser slurm cluster cluster-down test gpu-check lab lab-copy lab-fresh notebooks clean distclean

help:
	@echo "labsupport workbook"
	@echo
	@echo "  make lab        install (once) and start JupyterLab on $(LAB_IP) in $(WORK)/, your copy of the notebooks (LAB_ARGS=...)"
	@echo "                  copied without outputs; OUTPUTS=keep copies them with the stored outputs (instructors)"
	@echo "  make lab-fresh  move $(WORK)/ aside to $(WORK).bak-DATE-TIME, then make lab with fresh copies"
	@echo "  make test       unit, multi-process, notebook (nbval) and browser tests"
	@echo "  make gpu-check  every strategy that fits this machine's GPUs, run and checked (skips without a GPU)"
	@echo "  make notebooks  re-execute every notebook in place and store its outputs"
	@echo "  make venv       create .venv: $(TORCH_PIN) first, DeepSpeed built against it, then the package with [lab] and [dev]"
	@echo "  make browser    make sure Chromium is there for the browser tests (apt-get, as root)"
	@echo "  make slurm      make sure Slurm and munge are there for the cluster tests (apt-get, as root)"
	@echo "  make cluster    start a two-node Slurm on this machine to submit job scripts to (root); make cluster-down stops it"
	@echo "  make clean      remove runs/ and caches (keeps .venv)"
	@echo "  make distclean  clean, and remove .venv too (never $(WORK)/)"

venv: $(DEV_STAMP)

$(TORCH_STAMP): Makefile
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_PIN)"
	touch $@

# DeepSpeed is published as source only and its build imports torch: built without isolation,
# against the pinned torch already installed (an isolated build would fetch another torch to
# build with). The package lists it too, so the next step finds it there.
$(DEEPSPEED_STAMP): $(TORCH_STAMP)
	$(VPY) -m pip install setuptools wheel
	$(VPY) -m pip install --no-build-isolation deepspeed
	touch $@

$(LAB_STAMP): $(DEEPSPEED_STAMP) pyproject.toml
	$(VPY) -m pip install -e ".[lab]"
	touch $@

$(DEV_STAMP): $(LAB_STAMP)
	$(VPY) -m pip install -e ".[lab,dev]"
	touch $@

# Never fails: without Chromium the browser tests skip themselves.
browser:
	@if [ -x "$(CHROMIUM)" ]; then \
		echo "browser: $(CHROMIUM) is there"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "browser: installing chromium with apt-get"; \
		if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }; then \
			echo "browser: apt-get could not install chromium; browser tests will be skipped"; \
		fi; \
	else \
		echo "browser: $(CHROMIUM) is missing and cannot be installed here (needs root and apt-get); browser tests will be skipped"; \
	fi

# Never fails: without Slurm the cluster tests (tests/test_slurm_cluster.py) skip themselves.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
		&& command -v munged >/dev/null; then \
		echo "slurm: slurmctld, slurmd, sbatch and munged are there"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "slurm: installing $(SLURM_PACKAGES) with apt-get"; \
		if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES); }; then \
			echo "slurm: apt-get could not install Slurm; the cluster tests will be skipped"; \
		fi; \
	else \
		echo "slurm: Slurm is missing and cannot be installed here (needs root and apt-get); the cluster tests will be skipped"; \
	fi

# A two-node Slurm on this machine for trying the job scripts (root; labsupport/cluster.py).
CLUSTER_DIR ?= /tmp/labsupport-cluster
cluster: $(LAB_STAMP) slurm
	$(VPY) -m labsupport.cluster up --dir $(CLUSTER_DIR)

cluster-down:
	$(VPY) -m labsupport.cluster down --dir $(CLUSTER_DIR)

test: $(DEV_STAMP) browser slurm
	$(RUN_ENV) $(VPY) -m pytest tests $(wildcard notebooks) \
		--nbval-lax --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 300 \
		-n $(TEST_WORKERS) --dist loadscope -q -ra --durations=15 $(PYTEST_ARGS)

# The GPU paths in one command (labsupport/gpu_check.py): one line per check; without a GPU it says it
# skipped and succeeds, so CI can call it too.
gpu-check: $(LAB_STAMP)
	$(RUN_ENV) $(VPY) -m labsupport.cli doctor --gpu

# As root (a container, a CI box) JupyterLab refuses to start without --allow-root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

# JupyterLab saves outputs into the notebooks it runs, so it serves a copy, $(WORK)/, and the
# tracked notebooks/ stay as they are (`git pull` never conflicts). The copy is made on first use
# and never overwritten: only a notebook it lacks (new upstream, or deleted to start it over) is
# copied in, without its outputs unless OUTPUTS=keep. README.md, ARCHITECTURE.md and configs/ are links
# to the real ones, laid out as in the repo, so the README's links open them and notebook 03 finds
# ../configs/accelerate as it does in notebooks/.
# Every kernel JupyterLab starts loads labsupport's magics (%%exercise, %ranks, %%torchrun), so an
# exercise cell works after a kernel restart without running the notebook's first cell again:
# IPython reads its configuration from $(LAB_IPYTHON), written here each time.
# Text outputs break lines between words, not inside them: JupyterLab's custom CSS
# (LabApp.custom_css, a <link> to custom/custom.css in its page) served from configs/jupyterlab/
# instead of ~/.jupyter/custom/, so that only this JupyterLab gets it (the file says why). The user's
# own Jupyter configuration still applies, except a tornado_settings of theirs, which this replaces.
LAB_CSS := $(CURDIR)/configs/jupyterlab
LAB_STYLE := --LabApp.custom_css=True '--ServerApp.tornado_settings={"static_custom_path": ["$(LAB_CSS)"]}'
LAB_IPYTHON := $(WORK)/.ipython
lab: $(LAB_STAMP)
	@$(MAKE) --no-print-directory lab-copy
	$(RUN_ENV) IPYTHONDIR="$(abspath $(LAB_IPYTHON))" $(VENV)/bin/jupyter lab --notebook-dir=$(WORK) --ip=$(LAB_IP) $(ROOT_FLAG) $(LAB_STYLE) $(LAB_ARGS)

# The copy and the kernels' configuration, without starting JupyterLab (`make lab` does this first).
lab-copy:
	@mkdir -p $(WORK)/notebooks $(LAB_IPYTHON)/profile_default
	@for f in README.md ARCHITECTURE.md configs; do \
		[ -e "$(WORK)/$$f" ] || [ -L "$(WORK)/$$f" ] || ln -s "../$$f" "$(WORK)/$$f"; \
	done
	@missing="$$(for nb in $(NOTEBOOKS); do [ -e "$(WORK)/$$nb" ] || echo "$$nb"; done)"; \
	[ -z "$$missing" ] || { \
		if [ "$(OUTPUTS)" = keep ]; then cp $$missing "$(WORK)/notebooks/"; \
		else $(VENV)/bin/jupyter nbconvert --log-level=WARN --to notebook --ClearOutputPreprocessor.enabled=True \
			--output-dir="$(WORK)/notebooks" $$missing; fi && \
		for nb in $$missing; do echo "lab: copied $$nb to $(WORK)/$$nb$(if $(filter keep,$(OUTPUTS)), with its outputs)"; done; }
	@printf '%s\n' "# Written by make lab: every kernel starts with labsupport's magics (also after a restart)." \
		"c.InteractiveShellApp.exec_lines = ['import labsupport as _ls; _ls.load_ipython_extension(get_ipython()); del _ls']" \
		> $(LAB_IPYTHON)/profile_default/ipython_kernel_config.py

# Never deletes: the old copy is moved aside first.
lab-fresh:
	@if [ -e $(WORK) ]; then \
		backup="$(WORK).bak-$$(date +%Y%m%d-%H%M%S)"; \
		if [ -e "$$backup" ]; then echo "lab-fresh: $$backup exists already; try again in a second"; exit 1; fi; \
		mv $(WORK) "$$backup" && echo "lab-fresh: moved your copy to $$backup"; \
	fi
	@$(MAKE) --no-print-directory lab

# Widget state and per-cell execution timestamps are not stored (they only churn diffs); a widget
# shown with labsupport.widgets.show keeps its static figure as the stored output.
# LABSUPPORT_STORED_COPY=1: the stored copy is for readers, so lab.lesson(...) cells print each lab's
# lesson there; the attendee's copy shows it only once the lab is solved.
notebooks: $(LAB_STAMP)
ifeq ($(NOTEBOOKS),)
	@echo "notebooks: no notebooks/*.ipynb to execute"
else
	$(RUN_ENV) LABSUPPORT_STORED_COPY=1 $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 \
		--ExecutePreprocessor.kernel_name=python3 \
		--ExecutePreprocessor.store_widget_state=False \
		--ExecutePreprocessor.record_timing=False \
		$(NOTEBOOKS)
	$(VPY) -m labsupport.widgets.show $(NOTEBOOKS)  # stored widgets keep their static figure only
endif

clean:
	rm -rf runs .pytest_cache tests/artifacts build dist *.egg-info
	find . -path ./.venv -prune -o -path ./.git -prune -o \
		-type d \( -name __pycache__ -o -name .ipynb_checkpoints \) -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
