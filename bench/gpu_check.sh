#!/usr/bin/env bash
# The GPU acceptance check (bench/gpu_acceptance.py) with the interpreter that sees a GPU: this
# checkout's .venv when its torch has CUDA, else the machine's python3 (on a GPU image, the one
# that holds PyTorch). podtrain runs from src/ (PYTHONPATH), so nothing is installed.
#   bash bench/gpu_check.sh [--budget-s 450] [--stages train,hang,...]   results: $OUT or runs/gpu-acceptance
#   bash bench/gpu_check.sh --dry-run                                    the CPU stand-in of every stage
#   bash bench/gpu_check.sh --plan                                       what each stage measures
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  PY=.venv/bin/python
elif ! python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python  # no GPU anywhere: the dry run, with the project's own interpreter
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_acceptance.py "$@"
