#!/usr/bin/env bash
# The GPU check of issue 2, as one prepared script for a session lent a GPU (under 5 minutes):
# the tiny and gpt2-124m presets, 50 steps each, CUDA + NCCL (world size 1) + bf16; prints
# tokens/s and MFU from metrics.jsonl. Usage: bash bench/gpu_check.sh  (from the repo root)
set -euo pipefail
PY=${PY:-.venv/bin/python}
if ! $PY -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  python3 -m venv .venv-gpu && PY=.venv-gpu/bin/python
  $PY -m pip install -q torch==2.13.0 && $PY -m pip install -q -e .
fi
$PY -m podtrain.cli prepare builtin --out data/builtin
for preset in tiny gpt2-124m; do
  run=runs/gpu-$preset; rm -rf "$run"
  $PY -m torch.distributed.run --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29612 \
    -m podtrain.cli train configs/demo.yaml model.preset=$preset run.dir=$run train.steps=50 \
    train.precision=bf16 dist.backend=nccl train.micro_batch_size=16 train.global_batch_size=32 \
    data.seq_len=1024 log.every=10 eval.every=0 ckpt.every=0 log.progress=plain
  $PY - "$run" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"kind":"train"' in l]
last = rows[-1]
print(f"{sys.argv[1]}: {last['tokens_per_s']:,.0f} tokens/s, MFU {last['mfu']}, loss {last['loss']:.3f}, "
      f"peak memory {last['max_mem_bytes'] / 2**30:.2f} GiB")
PYEOF
done
