# podtrain: two commands from a fresh clone.
#   make demo   install, prepare the built-in corpus, 2-process DDP pre-training on this machine
#   make test   install, then the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned (an open range lets pip pick the newest, multi-GB CUDA build). Where a local
# CPU wheel is configured (pip's find-links, as on CI) the pin takes it; elsewhere choose the
# build with TORCH_INDEX, e.g. https://download.pytorch.org/whl/cpu or .../whl/cu128.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
NPROC ?= 2
# The stamp names the torch choice, so changing TORCH_SPEC or TORCH_INDEX reinstalls.
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH_SPEC) $(TORCH_INDEX)' | md5sum | cut -c1-8)

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# The demo starts from scratch each time (a kept runs/demo would auto-resume at its last step).
demo: install
	$(VENV)/bin/podtrain prepare builtin --out data/builtin
	rm -rf runs/demo
	$(VENV)/bin/podtrain launch local configs/demo.yaml --nproc $(NPROC)
	$(VENV)/bin/podtrain sample runs/demo --prompt "$$(printf '\ndef ')" --max-new-tokens 300

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

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
