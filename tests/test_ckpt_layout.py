"""The one checkpoint layout on real ranks (forked, gloo): who writes, bytes read per rank on
resume, the collective fallback on a bad block, a failed background save, removed layouts."""

from __future__ import annotations

import errno
import json
import logging
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from multirank import gloo_context, run_ranks
from podtrain.ckpt import layout
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.load import piece_index
from podtrain.ckpt.plan import BLOCK_BYTES, block_crcs, split_even, spans, Piece
from podtrain.storage.posix import PosixStore
from podtrain.ckpt.tensorio import BlockHasher
from podtrain.ckpt.writer import SaveFailed
from podtrain.config import load_config
from podtrain.config_sections import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import AdamW and the state-dict API once here, so forked ranks do not each pay seconds."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    net, opt = _model(0)
    _train(net, opt, 1, seed=0)


# -- pure parts ------------------------------------------------------------------------------------
def test_split_even_covers_every_element_once_with_balanced_bytes():
    items = [("a", 1000, 4), ("b", 3, 4), ("empty", 0, 4), ("c", 777, 2), ("d", 1, 8)]
    for world in (1, 2, 3, 4, 7):
        plan = split_even(items, world)
        got: dict[str, list[tuple[int, int]]] = {}
        for ranges in plan:
            for name, start, count in ranges:
                got.setdefault(name, []).append((start, count))
        for name, numel, _ in items:
            ranges = sorted(got.get(name, []))
            assert sum(c for _, c in ranges) == numel and all(
                s == (ranges[i - 1][0] + ranges[i - 1][1] if i else 0) for i, (s, _) in enumerate(ranges))
        total = sum(n * e for _, n, e in items)
        sizes = [sum(c * dict((n, e) for n, _, e in items)[name] for name, _, c in r) for r in plan]
        assert max(sizes) - min(sizes) <= 2 * 8, (world, sizes)  # within an element at each cut
        assert sum(sizes) == total


def test_block_hasher_matches_per_piece_blocks_and_spans_round_out_to_blocks():
    import os

    sizes = [3 * BLOCK_BYTES + 5, 0, 17, BLOCK_BYTES]
    data = os.urandom(sum(sizes))
    hasher = BlockHasher(sizes)
    for cut in range(0, len(data), 100_003):  # chunks cut anywhere
        hasher.update(memoryview(data)[cut:cut + 100_003])
    pos = 0
    for size, crcs in zip(sizes, hasher.crcs):
        assert crcs == block_crcs(data[pos:pos + size])
        pos += size
    piece = Piece("t", 100, (3 * BLOCK_BYTES + 4) // 4, "f", 0, tuple(hasher.crcs[0]))
    (span,) = spans([piece], 100 + BLOCK_BYTES // 4 + 1, 10, 4)
    assert (span.first_block, span.last_block) == (1, 1) and span.byte_range(4) == (BLOCK_BYTES, BLOCK_BYTES)
    with pytest.raises(ValueError):
        spans([piece], 0, 10, 4)  # elements before the piece: not stored


def test_chunks_of_a_file_merge_into_bounded_reads_and_keep_their_place():
    from podtrain.ckpt.coalesce import Chunk, coalesce

    chunks = [Chunk("a", 100, 50, 1), Chunk("b", 0, 10, 2), Chunk("a", 0, 100, 3), Chunk("a", 150 + 64, 10, 4),
              Chunk("a", 1000, 10, 5), Chunk("a", 1010, 500, 6)]
    reads = coalesce(chunks, cap=300, gap=64)
    assert [(r.file, r.offset, r.length, [c.payload for c in r.chunks]) for r in reads] == [
        ("a", 0, 224, [3, 1, 4]),  # touching, then a 64-byte hole read over
        ("a", 1000, 10, [5]), ("a", 1010, 500, [6]),  # 510 bytes would pass the cap
        ("b", 0, 10, [2])]


def _mixed_dtypes() -> nn.Module:
    net = nn.Module()
    net.a = nn.Parameter(torch.randn(3).to(torch.bfloat16))  # 6 bytes: the next piece sits off 4-byte alignment
    net.b = nn.Parameter(torch.randn(5))
    return net


def test_a_resume_reads_pieces_of_mixed_dtypes_merged_into_one_read(tmp_path):
    net, other = _mixed_dtypes(), _mixed_dtypes()
    ck = Checkpointer(tmp_path, CkptSection(), _ctx())
    ck.save(1, net, torch.optim.SGD(net.parameters(), lr=0.1), None, _state(1))
    ck.wait()
    assert ck.restore(other, torch.optim.SGD(other.parameters(), lr=0.1), None).step == 1
    ck.close()
    assert torch.equal(other.a, net.a) and torch.equal(other.b, net.b)


def test_removed_format_key_and_older_layout_are_one_line_refusals(tmp_path):
    with pytest.raises(UserError, match="'ckpt.format' was removed"):
        load_config(None, ["ckpt.format=dcp"])
    old = tmp_path / "ckpt" / "step_000005"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"format": "podtrain-ckpt/1", "files": {}}))
    with pytest.raises(UserError, match="podtrain-ckpt/1 layout") as err:
        layout.find_latest(PosixStore(str(tmp_path / "ckpt")))
    assert "\n" not in str(err.value)


# -- ranks -----------------------------------------------------------------------------------------
def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _train(net, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        net(torch.randn(4, 512, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _ctx() -> DistContext:
    return gloo_context()


def _state(step: int) -> dict:
    return {"step": step, "tokens_seen": 10 * step, "loader": {"consumed": step}, "run_id": "r"}


def _save_rank(rank, world, run_dir, steps):
    net, opt = _model(0)
    ck = Checkpointer(Path(run_dir), CkptSection(keep_last=0), _ctx())
    for step in steps:
        _train(net, opt, 1, seed=step)
        ck.save(step, net, opt, None, _state(step))
        ck.wait()
    ck.close()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _counted_resume_rank(rank, world, run_dir):
    counts = {"data": 0, "small": 0}
    read_into = PosixStore.read_into

    def counting_read_into(self, name, offset, buf):  # every read of the store comes through here
        counts["data" if "/rank_" in name else "small"] += memoryview(buf).nbytes
        return read_into(self, name, offset, buf)

    PosixStore.read_into = counting_read_into
    net, opt = _model(1)
    ck = Checkpointer(Path(run_dir), CkptSection(), _ctx())
    state = ck.restore(net, opt, None)
    ck.close()
    return state.step, counts, {k: v.clone() for k, v in net.state_dict().items()}, len(opt.state)


@pytest.mark.slow
def test_every_ddp_rank_writes_its_share_and_a_resume_reads_its_share_at_1_2_4_ranks(tmp_path):
    saved = run_ranks(_save_rank, 2, str(tmp_path), [3])[0]
    folder = tmp_path / "ckpt" / "step_000003"
    manifest = json.loads((folder / "manifest.json").read_text())
    pieces: dict[str, list] = {}
    for found in piece_index(manifest, PosixStore(str(tmp_path / "ckpt")), folder.name).values():
        for p in found:
            pieces.setdefault(p.file, []).append(p)
    assert sorted(pieces) == ["rank_00000.safetensors", "rank_00001.safetensors"]  # both ranks wrote
    data = sum(p.count * 4 for found in pieces.values() for p in found)
    assert abs(len(pieces["rank_00000.safetensors"]) - len(pieces["rank_00001.safetensors"])) < 30
    small = sum(manifest["files"][f]["bytes"] for f in ("state.json", "state.safetensors"))
    small += (folder / "manifest.json").stat().st_size + (tmp_path / "ckpt" / "latest").stat().st_size
    small += 2 * max(p.stat().st_size for p in folder.glob("meta_*.json"))  # the sidecars of its ranges
    for world in (1, 2, 4):
        results = run_ranks(_counted_resume_rank, world, str(tmp_path))
        for step, counts, weights, optim in results:
            assert step == 3 and optim == 12
            assert all(torch.equal(weights[k], saved[k]) for k in saved)
            assert counts["data"] <= 1.1 * data / world, (world, counts, data)
            assert counts["small"] <= 2 * small  # manifest (rank 0), state files: no tensor data


def _corrupt_resume_rank(rank, world, run_dir):
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("podtrain.checkpoint").addHandler(handler)
    net, opt = _model(1)
    ck = Checkpointer(Path(run_dir), CkptSection(), _ctx())
    state = ck.restore(net, opt, None)
    ck.close()
    return state.step, [m for m in records if "failed its checks" in m], {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.slow
def test_a_bad_block_on_one_rank_makes_every_rank_fall_back_together(tmp_path):
    net, opt = _model(0)
    _train(net, opt, 1, seed=1)  # what every rank trains before its save of step 1
    at_one = net.state_dict()
    run_ranks(_save_rank, 2, str(tmp_path), [1, 2])
    victim = tmp_path / "ckpt" / "step_000002" / "rank_00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF  # same size: only rank 1's read of its share can notice
    victim.write_bytes(bytes(raw))
    results = run_ranks(_corrupt_resume_rank, 2, str(tmp_path))
    for step, lines, weights in results:
        assert step == 1 and all(torch.equal(weights[k], at_one[k]) for k in at_one)
    assert len(results[0][1]) == 1 and "step_000002" in results[0][1][0] and "rank 1" in results[0][1][0]


def _tiny(seed: int):
    from podtrain.model import build_model, preset_config

    net = build_model(preset_config("tiny"), "eager", seed=seed)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _tiny_step(net, opt) -> None:
    rows = torch.arange(33).remainder(320).view(1, 33)
    net(input_ids=rows[:, :-1], labels=rows[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _only_ckpt_corrupt_rank(rank, world, run_dir):
    """Save step 1 (both ranks), corrupt rank 1's file, then restore as a fresh relaunch would."""

    from podtrain.ckpt.state import capture_rng
    from podtrain.train.recovery import reinitialise

    net, opt = _tiny(7)
    _tiny_step(net, opt)
    ck = Checkpointer(Path(run_dir), CkptSection(), _ctx())
    ck.save(1, net, opt, None, _state(1))
    ck.wait()
    torch.distributed.barrier()
    if rank == 1:
        victim = Path(run_dir) / "ckpt" / "step_000001" / "rank_00001.safetensors"
        raw = bytearray(victim.read_bytes())
        raw[-100] ^= 0xFF  # rank 0's share reads fine and lands in its live tensors first
        victim.write_bytes(bytes(raw))
    torch.distributed.barrier()
    net, opt = _tiny(7)  # the relaunch: built from run.seed
    rng = capture_rng(torch.device("cpu"))["torch"]
    state = ck.restore(net, opt, None, fresh=lambda: reinitialise(net, ck.ctx, False, 7, "eager"))
    ck.close()
    same_rng = torch.equal(rng, torch.get_rng_state())
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    optim = len(opt.state)
    _tiny_step(net, opt)  # training proceeds from the fresh state
    return state, weights, optim, same_rng, {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.slow
def test_a_corrupt_only_checkpoint_starts_every_rank_fresh_from_the_seed(tmp_path):
    fresh, opt = _tiny(7)
    expected = {k: v.clone() for k, v in fresh.state_dict().items()}
    _tiny_step(fresh, opt)
    after_step = fresh.state_dict()
    results = run_ranks(_only_ckpt_corrupt_rank, 2, str(tmp_path))
    for state, weights, optim, same_rng, trained in results:
        assert state is None and optim == 0 and same_rng
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
        assert all(torch.equal(trained[k], after_step[k]) for k in after_step)


def _failing_save_rank(rank, world, run_dir):
    from podtrain.train.signals import StopSignal
    import contextlib
    import time

    net, opt = _model(0)
    ck = Checkpointer(Path(run_dir), CkptSection(), _ctx())
    ck.save(1, net, opt, None, _state(1))
    ck.wait()
    if rank == 1:  # this rank's disk fills up
        original = PosixStore.open_write

        @contextlib.contextmanager
        def full(self, name):
            with original(self, name) as fh:
                fh.write(b"x" * 1000)
                raise OSError(errno.ENOSPC, "No space left on device")
                yield fh

        PosixStore.open_write = full
    _train(net, opt, 1, seed=2)
    ck.save(2, net, opt, None, _state(2))
    stop, error = StopSignal([]), None
    for boundary in range(200):  # the loop's step boundaries
        try:
            if stop.should_stop(ck.ctx, ck.failed):
                assert stop.save_failed_agreed
                ck.wait()
        except SaveFailed as exc:
            error = (boundary > 0, str(exc))
            break
        time.sleep(0.01)
    ck._pending = None
    ck.close()
    stop.drain()
    return error


def test_a_failed_background_save_stops_every_rank_with_one_line_and_cleans_up(tmp_path):
    results = run_ranks(_failing_save_rank, 2, str(tmp_path))
    assert results[0] == results[1] and results[0] is not None
    line = results[0][1]
    assert "\n" not in line and "No space left on device" in line and "rank 1" in line
    assert line.endswith(f"{tmp_path / 'ckpt'}/step_000001)")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "owner.json", "step_000001"]
