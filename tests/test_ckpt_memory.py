"""Checkpoints within a host memory budget: streamed saves, rank-local shares, a resume through the
bounded pool, measured on real processes (forked, gloo) with the pool's own accounting and the kernel's
peak-RSS counter (VmHWM, reset through /proc/self/clear_refs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from multirank import run_ranks
from podtrain.ckpt import layout
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.host_buffers import MIB, StagingPool
from podtrain.config import load_config
from podtrain.config_sections import CkptSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext, process_group
from podtrain.errors import UserError
from test_checkpoint import same_optimizer, same_state, single_ctx, tiny, train_state, train_steps, weights


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import transformers' Llama, AdamW and the state-dict API once, so forked ranks do not each pay."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    model, opt = tiny()
    train_steps(model, opt, 1, seed=0)


def ckpt_files(run_dir: Path, step: int) -> dict[str, object]:
    """Every file of a checkpoint but the manifest (which records the creation time); a sidecar as
    its decoded body less its save id (every save has its own)."""
    from podtrain.ckpt import sidecar

    folder = run_dir / "ckpt" / layout.step_name(step)
    out: dict[str, object] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != layout.MANIFEST:
            data = p.read_bytes()
            if p.name.startswith("meta_"):
                body = sidecar.decode(data, str(p))
                body.pop("save_id")
                out[p.relative_to(folder).as_posix()] = body
            else:
                out[p.relative_to(folder).as_posix()] = data
    return out


def _save_and_resume(rank, world, run_dirs, budget_mb):
    """Save the same trained state twice (unbounded, then ``budget_mb``), resume from the second."""
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, opt = tiny(seed=0)
        train_steps(model, opt, 2, seed=7)
        staged = {}
        for run_dir, mb in zip(run_dirs, (None, budget_mb)):
            ck = Checkpointer(Path(run_dir), CkptSection(host_staging_mb=mb), ctx)
            ck.save(2, model, opt, None, train_state(2))
            stream = ck._pending.stream
            ck.wait()
            staged[mb] = (stream.staged_bytes if stream else 0, ck._pool.peak_in_use_bytes,
                          ck._pool.allocated_bytes, ck._pool.budget_bytes)
            ck.close()
        model2, opt2 = tiny(seed=1)
        train_steps(model2, opt2, 1, seed=3)
        ck = Checkpointer(Path(run_dirs[1]), CkptSection(host_staging_mb=budget_mb), ctx)
        ck.restore(model2, opt2, None)
        read_peak = ck._pool.peak_in_use_bytes
        ck.close()
        return {"staged": staged, "read_peak": read_peak, "weights": same_state(weights(model), weights(model2)),
                "optimizer": same_optimizer(opt, opt2)}


@pytest.mark.slow
def test_small_budget_writes_the_same_bytes_and_resumes_exactly(tmp_path):
    dirs = [str(tmp_path / "unbounded"), str(tmp_path / "small")]
    results = run_ranks(_save_and_resume, 2, dirs, 1.0, timeout=90)
    big, small = (ckpt_files(Path(d), 2) for d in dirs)
    assert big.keys() == small.keys() and all(big[k] == small[k] for k in big), "files differ"
    total = sum(r["staged"][1.0][0] for r in results)
    for rank, r in enumerate(results):
        assert r["weights"] and r["optimizer"], f"rank {rank}: restore differs from the saved state"
        staged, peak, allocated, budget = r["staged"][1.0]
        assert budget == MIB and peak <= budget and allocated <= budget, r["staged"]
        assert 0 < r["read_peak"] <= budget  # the resume read through the same bounded pool
        # each rank stages only its share: about half each, together everything
        assert 0.45 * total < staged < 0.55 * total, (staged, total)
    model, _ = tiny()
    weights_bytes = sum(p.numel() * 4 for p in model.parameters())  # tied embedding counted once
    assert abs(total - 3 * weights_bytes) < 0.01 * total  # weights + AdamW moments, 20x the budget
    assert sorted(k for k in big if k.startswith("rank_")) == ["rank_00000.safetensors",
                                                             "rank_00001.safetensors"]


def _peak_rss_rank(rank, world, run_dir, budget_mb):
    """In a fresh forked process: the peak RSS a save and a resume add, and what they hold."""
    def hwm_after(fn) -> int:
        rss = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
        fn()
        return _status("VmHWM") - rss

    torch.manual_seed(0)
    ctx = single_ctx()
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)])  # 16.8M params
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    cfg = CkptSection(host_staging_mb=budget_mb, async_save=False)
    ck = Checkpointer(Path(run_dir), cfg, ctx)
    save_extra = hwm_after(lambda: ck.save(1, model, opt, None, train_state(1)))
    ck.close()
    model2 = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)])
    opt2 = torch.optim.AdamW(model2.parameters())
    ck = Checkpointer(Path(run_dir), cfg, ctx)
    load_extra = hwm_after(lambda: ck.restore(model2, opt2, None))
    ck.close()
    weights_bytes = sum(p.numel() * 4 for p in model.parameters())
    return save_extra, load_extra, weights_bytes, same_optimizer(opt, opt2)


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


@pytest.mark.slow
def test_peak_rss_of_a_save_and_a_resume(tmp_path):
    save_extra, load_extra, weights_bytes, same = run_ranks(_peak_rss_rank, 1, str(tmp_path), 4.0,
                                                            timeout=120)[0]
    assert same
    # A full host copy would add 4 x the weights (weights + AdamW's two moments: 16 bytes/param).
    assert save_extra <= 4 * MIB + 0.25 * weights_bytes, (save_extra, weights_bytes)
    # Resuming on the CPU must allocate AdamW's two moments (2 x weights; allocated from the
    # checkpoint's table, not by torch's fake step); reading the files whole first would add
    # another copy of the weights and of the moments on top.
    assert load_extra <= 2.25 * weights_bytes, (load_extra, weights_bytes)


def _fail_mid_stream(rank, world, run_dir):
    import podtrain.ckpt.writer as writer

    def broken(fh, specs, chunks, metadata=None):
        next(iter(chunks))  # take one slab, then fail: the step loop is still staging
        raise OSError(28, "No space left on device", fh.name)

    writer.write_pieces = broken
    model, opt = tiny()
    train_steps(model, opt, 1, seed=1)
    ck = Checkpointer(Path(run_dir), CkptSection(host_staging_mb=1), single_ctx())
    ck.save(1, model, opt, None, train_state(1))  # must return although the pool stays full
    try:
        ck.wait()
    except UserError as exc:
        return str(exc), ck._pool._in_use
    finally:
        ck.close()
    return None, ck._pool._in_use


def test_writer_failure_mid_stream_releases_the_step_loop(tmp_path):
    error, in_use = run_ranks(_fail_mid_stream, 1, str(tmp_path), timeout=60)[0]
    assert error and "No space left" in error and "step 1" in error
    assert in_use == 0  # every slab went back to the pool
    assert not list((tmp_path / "ckpt").glob("step_*"))


def test_bad_budgets_are_one_line_errors(tmp_path):
    for value, message in (("0.5", "must be at least 1"), ("-3", "must be at least 1"),
                           ("abc", "expects a number")):
        with pytest.raises(UserError, match=message) as err:
            load_config(None, [f"ckpt.host_staging_mb={value}"])
        assert "ckpt.host_staging_mb" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="exceeds the memory of host") as err:
        Checkpointer(tmp_path, CkptSection(host_staging_mb=1e12), single_ctx())
    assert "\n" not in str(err.value)
    ctx = DistContext(env=ClusterEnv.detect({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "8", "RANK": "0"}),
                      backend="gloo", device=torch.device("cpu"), initialized=False)
    budgets = []
    for context in (single_ctx(), ctx):
        ck = Checkpointer(tmp_path, CkptSection(), context)
        budgets.append(ck._pool.budget_bytes)
        ck.close()
    default, shared = budgets
    assert abs(default / shared - 8) < 0.01  # the default is shared by the node's ranks
