# podtrain: two commands from a fresh clone.
#   make demo   install podtrain alone, prepare the built-in corpus, 2-process DDP pre-training on
#               this machine, a sample
#   make test   install with the test extra, then the whole test suite, in parallel (pytest-xdist),
#               slowest tests listed
#   make check  the fast tier for the inner loop (~1 min): every test but those marked e2e (torchrun
#               subprocesses), cluster (real Slurm, network namespaces) or slow (1.5 s of CPU
#               and more: trainings, lm-eval, pip); `pytest -m "not e2e and not cluster and not slow"` by hand
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned (an open range lets pip pick the newest, multi-GB CUDA build). Where a local
# CPU wheel is configured (pip's find-links, as on CI) the pin takes it; elsewhere choose the
# build with TORCH_INDEX, e.g. https://download.pytorch.org/whl/cpu or .../whl/cu128.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
NPROC ?= 2
# The stamps name the torch choice, so changing TORCH_SPEC or TORCH_INDEX reinstalls.
TORCH_HASH := $(shell echo '$(TORCH_SPEC) $(TORCH_INDEX)' | md5sum | cut -c1-8)
TORCH_STAMP := $(VENV)/.torch-$(TORCH_HASH)
STAMP := $(VENV)/.installed-$(TORCH_HASH)
DEMO_STAMP := $(VENV)/.demo-$(TORCH_HASH)

# Test workers: one per usable core (a container's or taskset's share) and three more, at most 8.
# More than the cores because the end-to-end tests spend much of their time waiting (a 35 s slow
# save, a stalled rank, a rendezvous, Slurm's scheduling, a storage retry's back-off): measured on 2
# cores the same day with the same background load, 3 workers ran the suite in 764 s, 5 in 685 s
# (earlier: 2 workers ~600 s, 3 workers 505 s, on a smaller suite). --dist loadgroup keeps the tests
# that share a trained run, and the Slurm and network-namespace tests, on one worker each (tests/conftest.py).
TEST_WORKERS ?= $(shell python3 -c 'import os; print(min(8, len(os.sched_getaffinity(0)) + 3))' 2>/dev/null || echo 5)
# Bytecode: every rank, torchrun agent and CLI subprocess imports torch and transformers afresh. uv
# installs without .pyc files, and where the environment sets PYTHONDONTWRITEBYTECODE (as these
# machines do) Python never caches them, so each process compiled ~1,500 source files again: a
# 2-step `launch local` took 38 s here, 17.7 s with the cache. The suite and the demo write bytecode
# once, into the venv (PYTHONPYCACHEPREFIX: nothing lands in src/ or tests/), only for what is imported.
PYCACHE := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache
PYTEST := OMP_NUM_THREADS=1 $(PYCACHE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup
# On a fresh clone that cache is empty and the workers, starting together, each compiled the same
# ~3,900 modules to collect the suite (27 s of CPU each, 8 s warm), and the first ranks compiled
# torch's and transformers' training modules side by side: one process compiles them first, once
# per install (tests/compile_once.py).
BYTECODE_STAMP := $(VENV)/.bytecode-$(TORCH_HASH)

.PHONY: install install-demo demo test check bench clean

# What `make test` needs: podtrain with the test extra (moto, s3torchconnector, lm-eval, ...).
install: $(STAMP)

# What `make demo` needs: podtrain and its own dependencies, no extra (the demo uses no eval
# task, tracker, plot or S3; its trackers=auto finds no TensorBoard and writes metrics.jsonl only).
install-demo: $(DEMO_STAMP)

$(TORCH_STAMP):
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	@rm -f $(VENV)/.torch-* $(VENV)/.installed-* $(VENV)/.demo-* $(VENV)/.bytecode-*
	@touch $@

# torch with pip (pip's configuration may point at a local CPU wheel), the rest with uv (parallel
# downloads and installs: seconds from a warm cache, where pip takes ~100 s), which keeps the torch
# just installed (the pin on its command line); pip does it where uv cannot (no PyPI, no uv wheel).
$(STAMP): pyproject.toml $(TORCH_STAMP)
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(PY) -e '.[test]' '$(TORCH_SPEC)' \
	  || $(PY) -m pip install -q -e '.[test]'
	@touch $@ $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml $(TORCH_STAMP)
	$(PY) -m pip install -q -e .
	@touch $@

# The demo starts from scratch each time (a kept runs/demo would auto-resume at its last step).
demo: install-demo
	$(PYCACHE) $(VENV)/bin/podtrain prepare builtin --out data/builtin
	rm -rf runs/demo
	$(PYCACHE) $(VENV)/bin/podtrain launch local configs/demo.yaml --nproc $(NPROC)
	$(PYCACHE) $(VENV)/bin/podtrain sample runs/demo --prompt "$$(printf '\ndef ')" --max-new-tokens 300

$(BYTECODE_STAMP): $(STAMP)
	@OMP_NUM_THREADS=1 $(PYCACHE) $(PY) tests/compile_once.py > $(VENV)/compile_once.log 2>&1 \
	  || { cat $(VENV)/compile_once.log; exit 1; }
	@touch $@

test: install $(BYTECODE_STAMP)
	$(PYTEST) --durations=15

check: install $(BYTECODE_STAMP)
	$(PYTEST) -m "not e2e and not cluster and not slow"

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/train_throughput.py
	$(PY) bench/loader_throughput.py
	$(PY) bench/prepare_throughput.py
	$(PY) bench/prepare_scale.py
	$(PY) bench/checkpoint_stall.py
	$(PY) bench/checkpoint_memory.py
	$(PY) bench/storage_throughput.py
	$(PY) bench/collectives_overhead.py
	$(PY) bench/fsdp_memory.py

clean:
	rm -rf runs data
