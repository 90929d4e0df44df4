"""Checkpointer on real ranks (forked, gloo): round trip, validation, refusal, retention, signals."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from multirank import run_ranks
from podtrain.ckpt import layout
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.reader import load_latest_weights
from podtrain.ckpt.state import restore_rng
from podtrain.ckpt.tensorio import TensorSpec, write_pieces
from podtrain.config_sections import CkptSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext, process_group
from podtrain.errors import UserError
from podtrain.model import build_model, preset_config

VOCAB = 320


# -- helpers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import transformers' Llama and DCP once here, so forked ranks do not each pay ~5 s."""
    import torch.distributed.checkpoint  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    model, opt = tiny()
    train_steps(model, opt, 1, seed=0)


def single_ctx() -> DistContext:
    """One process, no process group."""
    return DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"),
                       initialized=False)


def tiny(seed: int = 0):
    model = build_model(preset_config("tiny", VOCAB), seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_steps(model, opt, n: int, seed: int) -> None:
    """``n`` optimizer steps on a batch fixed by ``seed`` (the same batch on every rank)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (2, 65), generator=g)
        model(input_ids=x[:, :-1], labels=x[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def train_state(step: int) -> dict:
    return {"step": step, "tokens_seen": step * 128, "loader": {"epoch": 0, "consumed": 4 * step},
            "run_id": "abc123", "config": {"run": {"dir": "x"}, "ckpt": {"signals": ["SIGTERM"]}}}


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_optimizer(o1, o2) -> bool:
    s1, s2 = o1.state_dict(), o2.state_dict()
    if s1["param_groups"] != s2["param_groups"] or s1["state"].keys() != s2["state"].keys():
        return False
    return all(same_state(s1["state"][k], s2["state"][k]) for k in s1["state"])


def draws() -> tuple:
    """One value from each RNG a checkpoint restores."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def seed_rngs(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def restore_once(run_dir: Path, cfg: CkptSection, model, opt):
    """A restore by a Checkpointer of its own, closed after (its lease must not go on renewing
    into later tests of this worker: a removed lease is reported as lost)."""
    ck = Checkpointer(run_dir, cfg, single_ctx())
    try:
        return ck.restore(model, opt, None)
    finally:
        ck.close()


def save_sync(run_dir: Path, step: int, model, opt, **cfg) -> None:
    ck = Checkpointer(run_dir, CkptSection(**cfg), single_ctx())
    ck.save(step, model, opt, None, train_state(step))
    ck.close()


class Records(logging.Handler):
    """Collects log messages of the checkpoint logger (inside forked ranks too)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("podtrain.checkpoint").addHandler(self)
        logging.getLogger("podtrain.checkpoint").setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        logging.getLogger("podtrain.checkpoint").removeHandler(self)


# -- round trip on 2 ranks -------------------------------------------------------------------------
def _roundtrip_rank(rank, world, run_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, opt = tiny(seed=0)
        ddp = DDP(model)
        train_steps(ddp, opt, 2, seed=7)
        seed_rngs(100 + rank)  # each rank's own RNG stream
        ck = Checkpointer(Path(run_dir), CkptSection(async_save=True), ctx)
        ck.save(2, ddp, opt, None, train_state(2))
        ck.wait()
        saved_w, expected = weights(model), draws()
        # One more step from the saved state: what a resumed run must reproduce bit for bit.
        train_steps(ddp, opt, 1, seed=9)
        continued = weights(model)
        ck.close()
        del ddp

        model2, opt2 = tiny(seed=1)  # different weights, fresh optimizer, other RNG states
        train_steps(model2, opt2, 1, seed=3)
        seed_rngs(999)
        ddp2 = DDP(model2)
        ck2 = Checkpointer(Path(run_dir), CkptSection(), ctx)
        state = ck2.restore(ddp2, opt2, None)
        restore_rng(state.rng, ctx.device)  # what the loop applies (saving.apply_resume)
        got_draws = draws()
        restored_w = weights(model2)
        opt_ok = True
        if rank == 0:
            model_ref, opt_ref = tiny(seed=0)
            train_steps(model_ref, opt_ref, 2, seed=7)
            opt_ok = same_optimizer(opt_ref, opt2)
        train_steps(ddp2, opt2, 1, seed=9)
        ck2.close()
        del ddp2
        return {"weights": same_state(saved_w, restored_w), "draws": expected == got_draws,
                "optimizer": opt_ok, "continued": same_state(continued, weights(model2)),
                "state": state}


@pytest.mark.slow
def test_roundtrip_two_ranks_bit_identical(tmp_path):
    results = run_ranks(_roundtrip_rank, 2, str(tmp_path), timeout=90)
    for rank, r in enumerate(results):
        assert r["weights"], f"rank {rank}: weights differ after restore"
        assert r["draws"], f"rank {rank}: RNG streams differ after restore"
        assert r["optimizer"], f"rank {rank}: optimizer state differs after restore"
        assert r["continued"], f"rank {rank}: the step after the restore differs"
        assert r["state"].step == 2 and r["state"].loader == {"epoch": 0, "consumed": 8}
        assert r["state"].run_id == "abc123" and r["state"].saved_world_size == 2
        assert r["state"].train_state["config"] == train_state(2)["config"]
    ckpt = tmp_path / "ckpt" / "step_000002"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {"state.safetensors", "state.json", "config.json"}
    assert manifest["ranks"]["sidecars"] == 2 and manifest["ranks"]["piece_files"] == 2  # both ranks wrote
    assert {p.name for p in ckpt.iterdir()} >= {"rank_00000.safetensors", "rank_00001.safetensors",
                                                 "meta_00000.json", "meta_00001.json"}  # their share and sidecar
    names = set(manifest["tensors"])
    assert not any(n.startswith(("model/module.", "model/_orig_mod.")) for n in names)
    assert "model/lm_head.weight" not in names  # tied to the embedding: stored once
    assert any(n.startswith("optim/state.model.embed_tokens.weight.") for n in names)  # keyed by name
    assert not list((tmp_path / "ckpt").rglob(".tmp-*"))


# -- which checkpoint is chosen --------------------------------------------------------------------
def test_partial_directories_are_never_chosen(tmp_path):
    model, opt = tiny()
    save_sync(tmp_path, 1, model, opt)
    train_steps(model, opt, 1, seed=1)
    step2 = weights(model)
    save_sync(tmp_path, 2, model, opt)
    root = tmp_path / "ckpt"
    # A step directory whose manifest never got written, with `latest` pointing at it, and the
    # temporary file of a writer killed mid-file in it.
    partial = root / "step_000004"
    partial.mkdir()
    tmp_file = partial / ".rank_00001.safetensors.k1ll.tmp"
    tmp_file.write_bytes(b"half a file")
    for f in (root / "step_000002").iterdir():
        if f.name != "manifest.json":
            (partial / f.name).write_bytes(f.read_bytes())
    (root / "latest").write_text("step_000004\n")

    model2, opt2 = tiny(seed=5)
    with Records() as rec:  # closed after: its lease must not renew into later tests (see restore_once)
        state = restore_once(tmp_path, CkptSection(), model2, opt2)
    assert state.step == 2 and same_state(step2, weights(model2))
    assert any("step_000004" in m and "unfinished" in m for m in rec.messages)
    assert not tmp_file.exists() and not partial.exists(), "a killed save's files are cleaned up"


def test_flipped_byte_is_skipped_with_a_warning(tmp_path):
    model, opt = tiny()
    save_sync(tmp_path, 1, model, opt)
    step1 = weights(model)
    train_steps(model, opt, 1, seed=1)
    save_sync(tmp_path, 2, model, opt)
    target = tmp_path / "ckpt" / "step_000002" / "rank_00000.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))

    model2, opt2 = tiny(seed=5)
    with Records() as rec:
        state = restore_once(tmp_path, CkptSection(), model2, opt2)
    assert state.step == 1 and same_state(step1, weights(model2))
    warning = [m for m in rec.messages if "failed its checks" in m]
    assert len(warning) == 1 and "step_000002" in warning[0] and "rank_00000.safetensors" in warning[0]
    assert "CRC-32" in warning[0] and "falls back to the previous checkpoint" in warning[0]


class _Payload:
    """Unpickling this creates a directory: the side effect the test must never see."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _craft_pickle_checkpoint(root: Path, side_effect: Path, name: str) -> Path:
    """A checkpoint as a pickle-based tool writes it, with a manifest whose checksums hold."""
    ckpt = root / "ckpt" / "step_000009"
    ckpt.mkdir(parents=True)
    blob = pickle.dumps({"model": _Payload(str(side_effect))})
    (ckpt / name).write_bytes(blob)
    manifest = {"format": layout.FORMAT, "step": 9, "world_size": 1, "tensors": {},
                "files": {name: {"bytes": len(blob)}}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def test_offline_reader_refuses_a_planted_pickle_file(tmp_path):
    """``sample``/``export`` read through ``load_latest``: the pickle file is named, never opened.

    The newer, pickle-holding checkpoint is refused rather than passed over for the valid older
    one. Unpickling the planted file at the end proves its payload is real, so the refusal tests
    here and below (``not side_effect.exists()``) guard against something that would happen.
    """
    model, opt = tiny()
    save_sync(tmp_path, 1, model, opt)
    side_effect = tmp_path / "pwned"
    ckpt = _craft_pickle_checkpoint(tmp_path, side_effect, "model.pt")
    with pytest.raises(UserError, match=r"step_000009 holds model\.pt, a pickle") as info:
        load_latest_weights(tmp_path)
    assert str(ckpt) in str(info.value)
    assert not side_effect.exists()
    pickle.loads((ckpt / "model.pt").read_bytes())
    assert side_effect.exists()


def _pickle_rank(rank, world, run_dir, resume):
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, opt = tiny()
        try:
            Checkpointer(Path(run_dir), CkptSection(resume=resume), ctx).restore(model, opt, None)
        except UserError as exc:
            return str(exc)
        return None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.pt", "optimizer.bin"])
def test_pickle_checkpoint_is_refused_and_its_payload_never_runs(tmp_path, name):
    """Named explicitly (ckpt.resume=PATH) it is refused on both ranks; under auto it is skipped
    with a warning for the older valid one (a stray file must not stop the job): never opened."""
    model, opt = tiny()
    save_sync(tmp_path, 1, model, opt)
    side_effect = tmp_path / "pwned"
    ckpt = _craft_pickle_checkpoint(tmp_path, side_effect, name)
    errors = run_ranks(_pickle_rank, 2, str(tmp_path), str(ckpt), timeout=60)
    for err in errors:  # both ranks refuse (rank 0 decided, rank 1 did not hang)
        assert err is not None and "pickle" in err and name in err and "step_000009" in err
    assert run_ranks(_pickle_rank, 2, str(tmp_path), "auto", timeout=60) == [None, None]
    assert not side_effect.exists()


def test_pickle_file_without_manifest_entry_skips_that_checkpoint(tmp_path, caplog):
    """A stray .pt in the newest step directory: resume takes the previous checkpoint, naming
    the file; the file is never unpickled."""
    model, opt = tiny()
    save_sync(tmp_path, 1, model, opt)
    save_sync(tmp_path, 2, model, opt)
    side_effect = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt" / "step_000002"
    torch.save({"x": _Payload(str(side_effect))}, ckpt / "extra.pt")  # zip container, pickle inside
    caplog.set_level("WARNING", logger="podtrain.checkpoint")
    ck = Checkpointer(tmp_path, CkptSection(), single_ctx())
    state = ck.restore(*tiny(), None)
    ck.close()
    assert state.step == 1 and "step_000002 holds extra.pt" in caplog.text
    with pytest.raises(UserError, match="extra.pt"):
        restore_once(tmp_path, CkptSection(resume=str(ckpt)), *tiny())
    assert not side_effect.exists()


def _exists_rank(rank, world, run_dir):
    import pathlib

    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, opt = tiny()
        train_steps(model, opt, 1, seed=rank)  # ranks differ before the restore
        if rank == 1:  # rank 1's view of the shared file system says nothing exists
            for name in ("exists", "is_file", "is_dir"):
                setattr(pathlib.Path, name, lambda self: False)
            os.path.exists = lambda p: False
            os.path.isfile = lambda p: False
            os.path.isdir = lambda p: False
        state = Checkpointer(Path(run_dir), CkptSection(), ctx).restore(model, opt, None)
        return state.step, [v.sum().item() for v in model.state_dict().values()]


@pytest.mark.slow
def test_exists_disagreeing_on_rank1_does_not_hang(tmp_path):
    model, opt = tiny()
    train_steps(model, opt, 2, seed=11)
    save_sync(tmp_path, 3, model, opt)
    started = time.monotonic()
    (s0, w0), (s1, w1) = run_ranks(_exists_rank, 2, str(tmp_path), timeout=60)
    assert s0 == s1 == 3 and w0 == w1
    assert time.monotonic() - started < 30


# -- retention, timelines, readers -----------------------------------------------------------------
def test_retention_keeps_last_k_and_every_nth(tmp_path):
    model, opt = tiny()
    ck = Checkpointer(tmp_path, CkptSection(keep_last=2, keep_every=4), single_ctx())
    for step in range(1, 10):
        ck.save(step, model, opt, None, train_state(step))  # async: each save waits for the last
    ck.close()
    kept = [s for s, _ in layout.list_checkpoints(tmp_path / "ckpt")]
    assert kept == [4, 8, 9]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_000009"
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]


def test_fresh_start_is_a_new_lineage_that_leaves_the_old_checkpoints_untouched(tmp_path):
    """ckpt.resume=never: a new lineage, whose checkpoints go beside the old run's (which owns
    the location); nothing of the old one is moved or deleted; readers follow the run's lineage."""
    model, opt = tiny()
    save_sync(tmp_path, 5, model, opt)
    old = json.loads((tmp_path / "lineage.json").read_text())["lineage"]
    ck = Checkpointer(tmp_path, CkptSection(resume="never"), single_ctx())
    assert ck.restore(model, opt, None) is None
    new = ck.identity.lineage
    ck.save(2, model, opt, None, train_state(2))
    ck.close()
    assert new != old and json.loads((tmp_path / "lineage.json").read_text())["lineage"] == new
    assert [s for s, _ in layout.list_checkpoints(tmp_path / "ckpt")] == [5]
    assert [s for s, _ in layout.list_checkpoints(tmp_path / "ckpt" / "runs" / new)] == [2]
    assert not (tmp_path / "ckpt" / "abandoned").exists()
    _, _, step = load_latest_weights(tmp_path)
    assert step == 2
    ck = Checkpointer(tmp_path, CkptSection(), single_ctx())
    state = ck.restore(model, opt, None)
    ck.close()
    assert state.step == 2  # auto: the run's own lineage, not the older run's step 5


def test_load_latest_weights_and_user_errors(tmp_path):
    model, opt = tiny()
    save_sync(tmp_path, 7, model, opt)
    config, state, step = load_latest_weights(tmp_path)
    assert step == 7 and config == train_state(7)["config"]
    assert same_state(weights(model), state)  # tied lm_head.weight restored under its own name
    with pytest.raises(UserError, match="does not exist"):
        load_latest_weights(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no complete checkpoint"):
        load_latest_weights(tmp_path / "empty")
    with pytest.raises(UserError, match="ckpt.resume"):
        restore_once(tmp_path, CkptSection(resume=str(tmp_path / "empty")), model, opt)


def test_other_architecture_is_a_user_error(tmp_path):
    model, opt = tiny()
    save_sync(tmp_path, 1, model, opt)
    other = build_model(preset_config("tiny", VOCAB + 64), seed=0)
    with pytest.raises(UserError, match="does not fit this model"):
        restore_once(tmp_path, CkptSection(), other, torch.optim.AdamW(other.parameters()))


def test_should_save_and_repeated_step(tmp_path):
    from podtrain.ckpt.interval import SaveSchedule

    assert [s for s in range(1, 11) if SaveSchedule(CkptSection(every=0), 0).should_save(s, 10)] == [10]
    assert [s for s in range(1, 11) if SaveSchedule(CkptSection(every=3), 0).should_save(s, 10)] == [3, 6, 9, 10]
    ck = Checkpointer(tmp_path, CkptSection(every=3), single_ctx())
    model, opt = tiny()
    ck.save(3, model, opt, None, train_state(3))
    ck.save(3, model, opt, None, train_state(3))  # a stop right after a scheduled save
    ck.close()
    assert [s for s, _ in layout.list_checkpoints(tmp_path / "ckpt")] == [3]


def test_piece_files_are_safetensors_the_library_reads(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.arange(7, dtype=torch.float32), "b": torch.tensor(3.5, dtype=torch.bfloat16),
               "c": torch.zeros(0, 4), "d": torch.tensor([True, False]), "e": torch.arange(6).reshape(2, 3)}
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    chunks = [memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B") for t in tensors.values() if t.numel()]
    with open(tmp_path / "x.safetensors", "wb") as fh:
        _, crcs, nbytes = write_pieces(fh, specs, chunks, {"k": "v"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert nbytes == (tmp_path / "x.safetensors").stat().st_size and len(crcs) == len(tensors)


# -- stop signals ----------------------------------------------------------------------------------
def _signal_rank(rank, world):
    from podtrain.train.signals import StopSignal

    with process_group(ClusterEnv.detect(), "gloo") as ctx, StopSignal(["SIGUSR1"]) as stop:
        answers = []
        for step in range(6):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            answers.append(stop.should_stop(ctx))
        return answers, stop.requested


def test_stop_signal_is_agreed_by_all_ranks_at_the_same_step():
    (a0, req0), (a1, req1) = run_ranks(_signal_rank, 2, timeout=60)
    # The signal lands before boundary 3; the agreement started there is read at boundary 4 (one
    # step of latency keeps the all_reduce off the critical path), on both ranks alike.
    assert a0 == a1 == [False, False, False, False, True, True]
    assert (req0, req1) == (False, True)


def test_stop_signal_single_process_and_handler_restore():
    from podtrain.train.signals import REQUEUE_EXIT_CODE, StopSignal, parse_signal

    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignal(["USR1", "sigterm"])
    assert not stop.should_stop(single_ctx())
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.should_stop(single_ctx()) and stop.seconds_since_signal() >= 0
    stop.restore()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert REQUEUE_EXIT_CODE == 143
    with pytest.raises(UserError, match="SIGFOO"):
        parse_signal("SIGFOO")
    with pytest.raises(UserError, match="cannot be caught"):
        parse_signal("SIGKILL")


def _other_world_rank(rank, world, run_dir):
    with process_group(ClusterEnv.detect(), "gloo") as ctx, Records() as rec:
        model, opt = tiny(seed=3)
        state = Checkpointer(Path(run_dir), CkptSection(), ctx).restore(model, opt, None)
        return state.step, state.saved_world_size, weights(model), rec.messages


@pytest.mark.slow
def test_resume_with_another_world_size_loads_weights_not_rng(tmp_path):
    model, opt = tiny()
    train_steps(model, opt, 2, seed=4)
    save_sync(tmp_path, 2, model, opt)  # saved by 1 process, resumed by 2
    results = run_ranks(_other_world_rank, 2, str(tmp_path), timeout=60)
    for step, saved_world, w, _ in results:
        assert step == 2 and saved_world == 1 and same_state(weights(model), w)
    assert any("saved by 1 rank(s), this run has 2" in m for m in results[0][3])


def _restore_failing_on_rank1(rank, world, run_dir):
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, opt = tiny()
        ckpt = Checkpointer(Path(run_dir), CkptSection(async_save=False), ctx)
        ckpt.save(3, model, opt, None, train_state(3))
        ckpt.wait()
        if rank == 1:  # this rank alone cannot load (e.g. a stale mount); the others must not wait
            import podtrain.ckpt.restore as module  # the resume half of Checkpointer

            def broken(*_args):
                raise UserError("weights unreadable here")
            module.prepare = broken
        try:
            ckpt.restore(model, opt, None)
        except UserError as exc:
            return str(exc)
        finally:
            ckpt.close()
        return None


def test_a_load_failure_on_one_rank_stops_every_rank(tmp_path):
    errors = run_ranks(_restore_failing_on_rank1, 2, str(tmp_path), timeout=60)
    # every rank says the same line, naming the rank that failed (the failure is agreed, not re-raised)
    assert errors[0] == errors[1]
    assert errors[0].startswith("resuming from ") and errors[0].endswith(
        "failed on rank 1: UserError: weights unreadable here")
