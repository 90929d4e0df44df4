"""Checkpoints on S3 (a local moto server, started here; needs the `test` extra), side by side:

    .venv/bin/python bench/checkpoint_s3.py [--preset gpt2-124m] [--rounds 2]

* podtrain: ``Checkpointer`` with ``ckpt.dir=s3://...`` at its defaults (one rank): ``save`` + ``wait``
  (host copy, block CRCs, multipart upload, manifest commit) and ``restore`` (ranged reads into
  the staging buffers, CRCs checked, copied into the model and AdamW);
* s3torchconnector: its own client ``put_object`` of the same tensor bytes (one object, 8 MiB
  writes) and ``get_object(...).read()`` of it back.
Medians over rounds after one warm-up round. The moto server (Python, in this process) is the
bottleneck: the ratios say what podtrain's checkpoint layer costs over the connector, not what
S3 itself would deliver.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the loopback S3 server the tests use


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from s3_server import restore_env, start_with_env
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.model import build_model, preset_config

    torch.set_num_threads(1)
    model = build_model(preset_config(args.preset), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    tensors = [*model.state_dict().values(), *[v for s in opt.state.values() for v in s.values()
                                               if isinstance(v, torch.Tensor) and v.dim()]]
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors]).numpy()
    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    server, saved = start_with_env()
    try:
        bucket = server.new_bucket()
        raw = S3Client(os.environ["AWS_REGION"], endpoint=os.environ["AWS_ENDPOINT_URL"],
                       s3client_config=S3ClientConfig(force_path_style=True))
        rows = []
        for rnd in range(args.rounds + 1):
            ck = Checkpointer(ROOT, CkptSection(dir=f"s3://{bucket}/pt", keep_last=1), ctx)
            t0 = time.perf_counter()
            ck.save(rnd + 1, model, opt, None, {"step": rnd + 1})
            ck.wait()
            pt_save = time.perf_counter() - t0
            t0 = time.perf_counter()
            ck.restore(model, opt, None)
            pt_load = time.perf_counter() - t0
            nbytes = ck.bytes_read
            ck.close()
            t0 = time.perf_counter()
            with raw.put_object(bucket, f"raw/r{rnd}") as w:
                view = memoryview(flat)
                for j in range(0, len(view), 8 << 20):
                    w.write(view[j:j + (8 << 20)])
            raw_save = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = raw.get_object(bucket, f"raw/r{rnd}").read()
            raw_load = time.perf_counter() - t0
            assert len(got) == flat.nbytes
            del got
            rows.append((pt_save, pt_load, raw_save, raw_load))
            print(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: podtrain save {pt_save:.1f} s load "
                  f"{pt_load:.1f} s ({nbytes / 1e6:.0f} MB read) | s3torchconnector put {raw_save:.1f} s "
                  f"get {raw_load:.1f} s ({flat.nbytes / 1e6:.0f} MB)", flush=True)
        ps, pl, rs, rl = (statistics.median(r[i] for r in rows[1:] or rows) for i in range(4))
        mb = flat.nbytes / 1e6
        print(f"{args.preset} weights + AdamW, {mb:.0f} MB, moto on loopback, medians of {len(rows[1:] or rows)}")
        print(f"  save: podtrain {mb / ps:6.1f} MB/s, s3torchconnector {mb / rs:6.1f} MB/s -> {rs / ps:.2f}x")
        print(f"  load: podtrain {mb / pl:6.1f} MB/s, s3torchconnector {mb / rl:6.1f} MB/s -> {rl / pl:.2f}x")
    finally:
        server.stop()
        restore_env(saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
