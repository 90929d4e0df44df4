# podtrain: two commands from a fresh clone.
#   make demo   install, prepare the built-in corpus, 2-process DDP pre-training on this machine
#   make test   install, then the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines get the CPU build of torch (an open range would pull a multi-GB CUDA build).
# On a GPU machine: make install TORCH_SPEC='torch==2.13.0' TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
NPROC ?= 2

.PHONY: install demo test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# The demo starts from scratch each time (a kept runs/demo would auto-resume at its last step).
demo: install
	$(VENV)/bin/podtrain prepare builtin --out data/builtin
	rm -rf runs/demo
	$(VENV)/bin/podtrain launch local configs/demo.yaml --nproc $(NPROC)
	$(VENV)/bin/podtrain sample runs/demo --prompt 'def ' --max-new-tokens 300

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

bench: install
	$(PY) bench/train_throughput.py

clean:
	rm -rf runs data
