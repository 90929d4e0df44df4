"""Checkpoint metadata that does not grow with the world (format podtrain-ckpt/3), and HSDP that
writes and reads each shard once, on real gloo ranks (forked) with FSDP2 on the CPU."""

from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
# Imported once here, not in each forked rank (DTensor and FSDP take seconds to import).
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401

from multirank import run_ranks
from podtrain.ckpt import layout
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.load import piece_index
from podtrain.ckpt.state import restore_rng
from podtrain.ckpt.tensorio import decode_small, encode_small
from podtrain.config_sections import CkptSection, DistSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import process_group
from podtrain.storage.posix import PosixStore

STEP = 2


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=64, max_position_embeddings=64,
                       tie_word_embeddings=True, use_cache=False)


def _sharded(ctx, strategy: str, shard_size: int | None, seed: int, steps: int = 1):
    """The model as the loop builds it under ``strategy``, an AdamW, ``steps`` optimizer steps."""
    from podtrain.train.precision import resolve_precision
    from podtrain.train.strategy import build_for_strategy, build_strategy

    model, reference = build_for_strategy(_config(), "eager", seed, strategy, ctx)
    chosen = build_strategy(DistSection(strategy=strategy, shard_size=shard_size), ctx,
                            resolve_precision("fp32", ctx.device), 16)
    wrapped = chosen.wrap(model, reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 17), generator=g)
        wrapped(input_ids=x[:, :-1], labels=x[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, wrapped, opt, chosen


def _local_state(model, opt) -> dict[str, torch.Tensor]:
    """This rank's local data of every checkpointed tensor (DTensor shards: the local shard)."""
    from podtrain.ckpt.statedict import flat_local, named_state

    return {n: flat_local(t).clone() for n, t in named_state(model, opt).tensors.items()}


def _received_counter():
    """Count the pickled bytes this rank receives through torch's object collectives (the real
    functions still run): {"bytes": n}."""
    import torch.distributed as dist

    counts = {"bytes": 0}
    real_gather, real_all_gather, real_bcast = dist.gather_object, dist.all_gather_object, dist.broadcast_object_list

    def gather_object(obj, object_gather_list=None, dst=None, group=None, **kw):
        real_gather(obj, object_gather_list, dst=dst, group=group, **kw)
        if object_gather_list is not None:
            me = dist.get_rank()
            counts["bytes"] += sum(len(pickle.dumps(o)) for i, o in enumerate(object_gather_list) if i != me)

    def all_gather_object(out, obj, group=None):
        real_all_gather(out, obj, group=group)
        me = dist.get_rank()
        counts["bytes"] += sum(len(pickle.dumps(o)) for i, o in enumerate(out) if i != me)

    def broadcast_object_list(objs, src=None, group=None, **kw):
        real_bcast(objs, src=src, group=group, **kw)
        if dist.get_rank() != src:
            counts["bytes"] += sum(len(pickle.dumps(o)) for o in objs)

    dist.gather_object, dist.all_gather_object, dist.broadcast_object_list = (
        gather_object, all_gather_object, broadcast_object_list)
    return counts


def _save_rank(rank, world, run_dir, strategy, shard_size):
    """One save under ``strategy``; the pickled bytes this rank received during it, its state."""
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, wrapped, opt, chosen = _sharded(ctx, strategy, shard_size, seed=3)
        ck = Checkpointer(Path(run_dir), CkptSection(async_save=False), ctx)
        counts = _received_counter()
        ck.save(STEP, wrapped, opt, None, {"step": STEP, "run_id": "m"})
        ck.wait()
        received = counts["bytes"]
        state = _local_state(model, opt)
        ck.close()
        chosen.release()
        return received, ck.last_save.get("received_bytes"), state


def _resume_rank(rank, world, run_dir, strategy, shard_size):
    """A resume under ``strategy`` into a model with other weights: bytes read by file kind,
    the restored local state, the plan's metadata figures."""
    counts = {"data": 0, "meta": 0}
    read_into = PosixStore.read_into

    def counting_read_into(self, name, offset, buf):  # every read of the store comes through here
        counts["data" if name.endswith(".safetensors") and "/rank_" in name else "meta"] += memoryview(buf).nbytes
        return read_into(self, name, offset, buf)

    PosixStore.read_into = counting_read_into
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, wrapped, opt, chosen = _sharded(ctx, strategy, shard_size, seed=11)
        torch.manual_seed(1000 + rank)
        ck = Checkpointer(Path(run_dir), CkptSection(), ctx)
        state = ck.restore(wrapped, opt, None)
        restore_rng(state.rng, ctx.device)
        draw = torch.rand(2).tolist()
        restored = _local_state(model, opt)
        ck.close()
        chosen.release()
        return counts, restored, dict(ck.restored.last_load), draw, state.saved_world_size


def _shared_bytes(folder: Path) -> int:
    return sum((folder / f).stat().st_size for f in (layout.MANIFEST, layout.STATE_JSON))


@pytest.mark.slow
def test_shared_metadata_and_collective_bytes_do_not_grow_from_2_to_4_fsdp_ranks(tmp_path):
    shared, received, counted = {}, {}, {}
    for world in (2, 4):
        results = run_ranks(_save_rank, world, str(tmp_path / f"w{world}"), "fsdp", None, timeout=120)
        folder = tmp_path / f"w{world}" / "ckpt" / layout.step_name(STEP)
        shared[world] = _shared_bytes(folder)
        received[world] = [r for r, _, _ in results]
        counted[world] = [c for _, c, _ in results]
    assert abs(shared[4] - shared[2]) <= 0.1 * shared[2], shared
    # ranks other than 0 receive only rank 0's broadcasts (O(1)); rank 0 gathers O(world) tiny records
    for world in (2, 4):
        assert all(0 < r <= 256 for r in received[world][1:]), received
    assert max(received[4][1:]) <= max(received[2][1:]), received
    # rank 0's tiny records come point to point (the writer's _gather), which the wrapped object
    # collectives do not see: the writer's own counter (for benches) says what rank 0 received
    assert 0 < counted[4][0] <= 3 * counted[2][0] and counted[4][0] < 4096, counted
    assert {w: c[1:] for w, c in counted.items()} == {w: r[1:] for w, r in received.items()}


def _tensor_bytes(manifest: dict) -> int:
    from podtrain.ckpt.tensorio import DTYPES, ELEMENT_SIZE

    total = 0
    for info in manifest["tensors"].values():
        n = 1
        for d in info["shape"]:
            n *= d
        total += n * ELEMENT_SIZE[DTYPES[info["dtype"]]]
    return total


@pytest.mark.slow
def test_hsdp_2x2_every_replica_group_writes_part_and_each_rank_reads_only_its_share(tmp_path):
    saved = run_ranks(_save_rank, 4, str(tmp_path), "hsdp", 2, timeout=120)
    folder = tmp_path / "ckpt" / layout.step_name(STEP)
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    written = {r: 0 for r in range(4)}
    for rank in range(4):  # what each rank's piece file holds, from its own safetensors header
        path = folder / layout.rank_file(rank)
        if path.exists():
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    if key.startswith("model/") and len(manifest["tensors"][key.split("[")[0]]["shape"]) == 2:
                        written[rank] += f.get_slice(key).get_shape()[0] * 4
    sharded = sum(written.values())
    by_group = [written[0] + written[1], written[2] + written[3]]  # replica group = rank // 2
    assert all(0.4 * sharded <= b <= 0.6 * sharded for b in by_group), (by_group, sharded)
    assert manifest["format"] == layout.FORMAT and manifest["mesh"] == {"shape": [2, 2]}

    total = _tensor_bytes(manifest)
    results = run_ranks(_resume_rank, 4, str(tmp_path), "hsdp", 2, timeout=120)
    for rank, (counts, restored, last_load, draw, saved_world) in enumerate(results):
        want = saved[rank][2]
        assert restored.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(restored[name], t), (rank, name)
        assert counts["data"] <= 1.15 * total / 4, (rank, counts, total)  # main: total / 2 (its whole shard)
        assert last_load["saved_ranks_read"] == [rank], last_load  # its own sidecar only
        assert saved_world == 4
    assert sum(c["data"] for c, *_ in results) <= 1.05 * total  # every byte read once


def _to_format_2(folder: Path) -> None:
    """Rewrite a podtrain-ckpt/3 checkpoint as podtrain 0.1's podtrain-ckpt/2 wrote it: every
    rank's pieces inline in the manifest, every rank's RNG states in state.json/.safetensors."""
    from podtrain.ckpt import sidecar

    manifest = json.loads((folder / layout.MANIFEST).read_text())
    state = json.loads((folder / layout.STATE_JSON).read_text())
    small = decode_small((folder / layout.STATE_FILE).read_bytes())
    files, rngs = {}, []
    for rank in range(manifest["world_size"]):
        body = sidecar.decode((folder / sidecar.sidecar(rank)).read_bytes(), "test")
        if body["file"]:
            files[body["file"]] = {"bytes": body["bytes"], "pieces": body["pieces"]}
        tensors = decode_small(__import__("base64").b64decode(body["rng_tensors"]))
        small.update({k.replace("rng/", f"rng/{rank}/", 1): v for k, v in tensors.items()})
        rngs.append(json.loads(json.dumps(body["rng"]).replace('"rng/', f'"rng/{rank}/')))
        (folder / sidecar.sidecar(rank)).unlink()
    state["rng"] = rngs
    blobs = {layout.STATE_JSON: json.dumps(state, indent=1).encode(), layout.STATE_FILE: encode_small(small)}
    for rel, data in blobs.items():
        (folder / rel).write_bytes(data)
        manifest["files"][rel] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    manifest["files"].update(files)
    manifest["format"] = "podtrain-ckpt/2"
    for key in ("ranks", "mesh", "crc32", "save_id"):  # what format 2 did not have (the CRC sealed format 3's)
        manifest.pop(key)
    for info in manifest["tensors"].values():
        info.pop("rule"), info.pop("replica", None)
    (folder / layout.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_a_format_2_checkpoint_still_resumes_exactly_with_its_rng_states(tmp_path):
    saved = run_ranks(_save_rank, 2, str(tmp_path / "new"), "fsdp", None, timeout=120)
    new = tmp_path / "new" / "ckpt" / layout.step_name(STEP)
    assert json.loads((new / layout.MANIFEST).read_text())["format"] == "podtrain-ckpt/3"
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    _to_format_2(tmp_path / "old" / "ckpt" / layout.step_name(STEP))
    new_runs = run_ranks(_resume_rank, 2, str(tmp_path / "new"), "fsdp", None, timeout=120)
    old_runs = run_ranks(_resume_rank, 2, str(tmp_path / "old"), "fsdp", None, timeout=120)
    for rank in range(2):
        for got in (new_runs[rank], old_runs[rank]):
            assert all(torch.equal(got[1][n], t) for n, t in saved[rank][2].items()), rank
        assert old_runs[rank][3] == new_runs[rank][3]  # the same RNG states restored
        assert old_runs[rank][4] == new_runs[rank][4] == 2
    assert old_runs[0][2]["saved_ranks_read"] == []  # format 2: the manifest held every piece


def test_a_damaged_or_missing_sidecar_makes_the_checkpoint_unusable(tmp_path):
    from podtrain.ckpt import sidecar

    run_ranks(_save_rank, 2, str(tmp_path / "a"), "fsdp", None, timeout=120)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    name = layout.step_name(STEP)
    # same size, one byte flipped: the sidecar's own CRC-32 catches it
    path = tmp_path / "a" / "ckpt" / name / sidecar.sidecar(1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    store = PosixStore(str(tmp_path / "a" / "ckpt"))
    with pytest.raises(Exception, match="meta_00001.json fails its CRC-32"):
        piece_index(layout.read_manifest(store, name), store, name)
    # a missing sidecar: the checkpoint is not complete (rank 0's listing, before any rank reads)
    (tmp_path / "b" / "ckpt" / name / sidecar.sidecar(1)).unlink()
    manifest, reason = layout.check(PosixStore(str(tmp_path / "b" / "ckpt")), name)
    assert manifest is None and "sidecars are 1 file(s)" in reason, reason


@pytest.mark.parametrize("mesh", [[4], [2, 2], [3, 2]])
def test_each_saved_rank_holds_exactly_what_the_rules_say_and_resumes_from_its_own_sidecar(mesh):
    """Pure: from a manifest's rules alone, every rank's ranges (``ranges_of``) are held by that
    rank only (``holders``), and together they cover every element of every tensor once."""
    from podtrain.ckpt.plan import assign_replicas
    from podtrain.ckpt.sidecar import SavedSplit

    world, rule = (mesh[0], "S") if len(mesh) == 1 else (mesh[0] * mesh[1], "RS")
    shapes = {f"model/w{i}": [7 + i, 5] for i in range(9)} | {"model/empty": [1, 3]}
    groups = assign_replicas([(n, s[0] * s[1] * 4) for n, s in shapes.items()], mesh[0] if rule == "RS" else 1)
    tensors = {n: {"shape": s, "dtype": "F32", "rule": rule, "replica": groups[n]} for n, s in shapes.items()}
    tensors |= {f"optim/step{i}": {"shape": [], "dtype": "F32", "rule": "even"} for i in range(5)}
    split = SavedSplit({"world_size": world, "mesh": {"shape": mesh}, "tensors": tensors})
    covered: dict[str, int] = {}
    for rank in range(world):
        for name, start, count in split.ranges_of(rank):
            assert split.holders(name, start, count) == {rank}, (rank, name, start, count)
            covered[name] = covered.get(name, 0) + count
    assert covered == {n: max(1, s[0] * s[1]) if s else 1 for n, s in
                       ((n, info["shape"]) for n, info in tensors.items())}
    if rule == "RS":  # every replica group writes a part
        assert {groups[n] for n in shapes} == set(range(mesh[0]))
