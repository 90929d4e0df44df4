"""The step loop's share of a save: what does not change between saves (the model config's JSON,
the tensor table, the plan of this rank's pieces) is built on the first save and reused, and built
again when it can change (a config attribute, a dtype, a tensor subclass, the world size).

Real ``Checkpointer`` saves to real files, one process; calls are counted, never timed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.statedict import local_pieces, named_state, tensor_table
from podtrain.config_sections import CkptSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext


def _model_and_optimizer():
    """A tiny Llama (a Hugging Face config with ``to_json_string``) and an AdamW that has stepped."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=64, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 9))
    model(input_ids=x[:, :-1], labels=x[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _checkpointer(folder: Path) -> Checkpointer:
    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    return Checkpointer(folder, CkptSection(async_save=True, keep_last=5), ctx)


def _saved(folder: Path, step: int, name: str) -> bytes:
    """The bytes of file ``name`` of the checkpoint of ``step`` (wherever the layout puts it)."""
    hits = [p for p in folder.rglob(name) if f"{step:06d}" in str(p.relative_to(folder))]
    assert len(hits) == 1, f"step {step}: {name} found at {hits}"
    return hits[0].read_bytes()


def test_second_save_does_not_serialise_the_config_or_rebuild_the_table(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    calls = []
    real = type(model.config).to_json_string

    def counted(self, *args, **kwargs):
        calls.append(id(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model.config), "to_json_string", counted)
    ck = _checkpointer(tmp_path)
    try:
        jobs = []
        for step in (1, 2, 3):
            assert ck.save(step, model, opt, None, {"step": step})
            jobs.append(ck._pending)
            ck.wait()
    finally:
        ck.close()
    assert calls == [id(model.config)], f"to_json_string ran {len(calls)} times over 3 saves (want 1: the first)"
    assert jobs[1].tensors is jobs[0].tensors and jobs[2].tensors is jobs[0].tensors, "the tensor table was rebuilt"
    assert jobs[1].pieces == jobs[0].pieces
    # What was written is what serialising and tabulating every time would write.
    for step in (1, 2, 3):
        assert json.loads(_saved(tmp_path, step, "config.json")) == json.loads(real(model.config))
        manifest = json.loads(_saved(tmp_path, step, "manifest.json"))
        assert manifest["tensors"] == tensor_table(named_state(model, opt).tensors)


def test_a_changed_config_is_serialised_again(tmp_path):
    model, opt = _model_and_optimizer()
    ck = _checkpointer(tmp_path)
    try:
        ck.save(1, model, opt, None, {"step": 1})
        ck.wait()
        model.config.initializer_range = 0.125  # an attribute set between saves
        model.config.rope_parameters = {**(getattr(model.config, "rope_parameters", None) or {}), "x": 1}
        ck.save(2, model, opt, None, {"step": 2})
        ck.wait()
    finally:
        ck.close()
    first = json.loads(_saved(tmp_path, 1, "config.json"))
    second = json.loads(_saved(tmp_path, 2, "config.json"))
    assert first["initializer_range"] != 0.125
    assert second["initializer_range"] == 0.125 and second["rope_parameters"]["x"] == 1
    assert second == json.loads(model.config.to_json_string())


def test_a_dtype_change_makes_a_new_table_and_restores(tmp_path):
    model, opt = _model_and_optimizer()
    ck = _checkpointer(tmp_path)
    try:
        ck.save(1, model, opt, None, {"step": 1})
        first = ck._pending
        ck.wait()
        model.to(torch.bfloat16)  # the parameters change dtype in place (the optimizer keeps them)
        ck.save(2, model, opt, None, {"step": 2})
        second = ck._pending
        ck.wait()
    finally:
        ck.close()
    assert second.tensors is not first.tensors
    assert first.tensors["model/model.embed_tokens.weight"]["dtype"] == "F32"
    assert second.tensors["model/model.embed_tokens.weight"]["dtype"] == "BF16"
    manifest = json.loads(_saved(tmp_path, 2, "manifest.json"))
    assert manifest["tensors"]["model/model.norm.weight"]["dtype"] == "BF16"
    # The bytes written are the bf16 ones: a bf16 model restores them exactly.
    other, other_opt = _model_and_optimizer()
    other.to(torch.bfloat16)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    ck = _checkpointer(tmp_path)
    try:
        state = ck.restore(other, other_opt, None)
    finally:
        ck.close()
    assert state is not None and state.step == 2
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_the_layout_follows_world_size_dtype_and_type():
    from podtrain.ckpt.statedict import SaveCache

    save_layout = SaveCache().layout  # one run's cache (a Checkpointer owns one)
    tensors = {"model/a": torch.arange(10, dtype=torch.float32), "model/b": torch.ones(3, 4),
               "optim/state.a.step": torch.tensor(1.0)}
    one = save_layout(tensors, 0, 1)
    assert save_layout(tensors, 0, 1) is one  # same tensors, same world: reused
    for rank, world in ((0, 2), (1, 2), (2, 3)):
        plan = save_layout(tensors, rank, world)
        want = local_pieces(tensors, rank, world)
        assert [(n, s, c) for n, s, c, _ in plan.ranges] == [(n, s, t.numel()) for n, s, t in want]
        assert all(torch.equal(got, exp) for (_, _, got), (_, _, exp) in zip(plan.pieces(tensors), want))
    assert save_layout(tensors, 0, 2).ranges != one.ranges
    fp8 = {**tensors, "model/a": tensors["model/a"].to(torch.float8_e4m3fn)}
    assert save_layout(fp8, 0, 1).table["model/a"]["dtype"] == "F8_E4M3"
    assert one.table["model/a"]["dtype"] == "F32"

    class Marked(torch.Tensor):
        """A tensor subclass (as FP8 training wraps weights): a new type, a new layout."""

    marked = {**tensors, "model/b": tensors["model/b"].as_subclass(Marked)}
    assert save_layout(marked, 0, 1) is not one
    reshaped = {**tensors, "model/b": torch.ones(4, 3)}
    assert save_layout(reshaped, 0, 1).table["model/b"]["shape"] == [4, 3]


def test_a_stream_that_fits_is_staged_before_the_writer_starts(tmp_path, monkeypatch):
    """The writer's start (storage requests, Python) must not contend with the copies for the GIL
    when the pool holds the whole stream; when it does not, the writer starts first (it drains
    the slabs the copies wait for), and both save the same state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from podtrain.ckpt.writer import CheckpointWriter

    at_submit = []
    real = CheckpointWriter.submit

    def recorded(self, job):
        at_submit.append((job.stream.staged_bytes, job.stream.nbytes))
        return real(self, job)

    monkeypatch.setattr(CheckpointWriter, "submit", recorded)
    small, opt = _model_and_optimizer()
    ck = _checkpointer(tmp_path / "fits")
    try:
        ck.save(1, small, opt, None, {"step": 1})
        ck.wait()
    finally:
        ck.close()
    staged, nbytes = at_submit[-1]
    assert nbytes > 0 and staged == nbytes, f"the writer started with {staged} of {nbytes} bytes staged"

    torch.manual_seed(0)
    big = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                       max_position_embeddings=64, use_cache=False))
    big_opt = torch.optim.AdamW(big.parameters(), lr=1e-3)
    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    ck = Checkpointer(tmp_path / "streams", CkptSection(async_save=True, keep_last=5, host_staging_mb=1.0), ctx)
    try:
        ck.save(1, big, big_opt, None, {"step": 1})
        ck.wait()
        other = LlamaForCausalLM(big.config)
        assert ck.restore(other, torch.optim.AdamW(other.parameters(), lr=1e-3), None).step == 1
    finally:
        ck.close()
    staged, nbytes = at_submit[-1]
    assert nbytes > 1024 * 1024 and staged == 0, f"a stream larger than the pool: writer started at {staged}"
    assert all(torch.equal(a, b) for a, b in zip(big.state_dict().values(), other.state_dict().values()))
