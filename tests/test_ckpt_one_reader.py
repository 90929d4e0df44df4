"""The checkpoint layer's one JSON reader (``ckpt.store.read_json``) and one fit check
(``ckpt.load.check_fit``): their outcomes, and the faults they now handle where each module's own
``json.loads`` did not (a small file that is JSON but not an object was a traceback)."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch

from podtrain.ckpt import hf_source, layout, reader
from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.store import NotFound, open_store
from podtrain.ckpt.tensorio import CorruptCheckpoint
from podtrain.config_sections import CkptSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.model import build_model, preset_config

VOCAB = 320


def _ctx() -> DistContext:
    return DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)


def test_read_json_outcomes_name_the_file(tmp_path):
    from podtrain.ckpt.store import read_json  # (imported here: the tests below run on the code before it too)

    (tmp_path / "ok.json").write_text('{"a": 1}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "torn.json").write_text('{"a": ')
    store = open_store(str(tmp_path))
    assert read_json(store, "ok.json") == {"a": 1}
    assert read_json(store, "ignored", data=b'{"b": 2}') == {"b": 2}  # bytes already read (a range read)
    for name, cause in (("list.json", "a list, not an object"), ("torn.json", "Expecting value")):
        with pytest.raises(ValueError) as err:
            read_json(store, name)
        assert str(err.value).startswith(f"{store.url}/{name} is not a JSON object (") and cause in str(err.value)
        with pytest.raises(CorruptCheckpoint, match=f"{name} is not a JSON object"):
            read_json(store, name, error=CorruptCheckpoint)
        assert read_json(store, name, error=None) is None
    with pytest.raises(UserError, match="^x: .*missing.json is not a JSON object"):  # a function making the error
        read_json(store, "missing.json", data=b"\xff", error=lambda m: UserError(f"x: {m}"))
    with pytest.raises(NotFound):  # absent is not damaged: raised unless the caller says what absent means
        read_json(store, "missing.json")
    assert read_json(store, "missing.json", missing=None) is None
    assert read_json(None, "peer header", data=b"{}") == {}  # no store: the name is the whole place


def test_one_fit_check_names_the_checkpoint_and_what_differs():
    from podtrain.ckpt.load import check_fit

    own = {f"model/w{i}": torch.zeros(2, 3) for i in range(5)}
    check_fit("here", {n: [2, 3] for n in own}, own)  # lists and tuples alike: fits
    stored = {**{f"model/w{i}": (2, 3) for i in range(4)}, "model/x": (1,)}
    stored["model/w0"] = (3, 2)
    with pytest.raises(UserError) as err:
        check_fit("s3://b/run/step_000002", stored, own, "this model and optimizer")
    assert str(err.value) == ("checkpoint s3://b/run/step_000002 does not fit this model and optimizer (missing: w4; "
                              "unexpected: x; shape differs: w0): was it saved with another model.preset or "
                              "vocabulary?")
    many = {f"w{i}": torch.zeros(1) for i in range(5)}
    with pytest.raises(UserError, match=r"\(missing: w0, w1, w2 \.\.\.\): "):
        check_fit("p", {}, many)
    # the offline readers use the same check (sample/export/eval): one message for one fault
    net = torch.nn.Linear(2, 3)
    with pytest.raises(UserError, match=r"^checkpoint ckpt/x does not fit this model \(shape differs: weight\)"):
        reader.load_weights(net, {"weight": torch.zeros(2, 2), "bias": torch.zeros(3)}, "ckpt/x")


def _damage_state_json(store, name: str, data: bytes) -> None:
    """Replace a checkpoint's state.json by ``data`` with a manifest record (and manifest CRC) that
    matches it: the bytes are what the writer wrote, they are just not a JSON object."""
    manifest = json.loads(store.read_bytes(f"{name}/{layout.MANIFEST}"))
    del manifest["crc32"]
    manifest["files"][layout.STATE_JSON].update(bytes=len(data), crc32=zlib.crc32(data))
    store.write_bytes(f"{name}/{layout.STATE_JSON}", data)
    store.write_bytes(f"{name}/{layout.MANIFEST}", layout.sealed_manifest(manifest))


def test_state_json_not_an_object_is_a_corrupt_checkpoint(tmp_path):
    """A state.json that matches its record but is not a JSON object: ``verify`` says so in one
    line and a resume falls back to the previous checkpoint (before: a traceback, on rank 0's
    choice as on ``verify``)."""
    model = build_model(preset_config("tiny", VOCAB), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(tmp_path, CkptSection(), _ctx())
    for step in (1, 2):
        ck.save(step, model, opt, None, {"step": step, "tokens_seen": 0, "run_id": "r"})
    ck.close()
    store = open_store(layout.run_ckpt_url(tmp_path))
    _damage_state_json(store, layout.step_name(2), b"[1, 2]")
    verdict = reader.verify(tmp_path / "ckpt" / layout.step_name(2))
    assert not verdict.ok and verdict.reason.endswith(
        f"{layout.step_name(2)}/{layout.STATE_JSON} is not a JSON object (a list, not an object)"), verdict
    assert reader.verify(tmp_path / "ckpt" / layout.step_name(1)).ok
    ck = Checkpointer(tmp_path, CkptSection(), _ctx())
    try:
        state = ck.restore(model, opt, None)
    finally:
        ck.close()
    assert state is not None and state.step == 1 and state.path.endswith(layout.step_name(1))


def test_hf_header_that_is_json_but_not_an_object_is_one_line(tmp_path):
    """A model.safetensors whose header parses as JSON but is not an object: one line naming the
    folder and the file (before: AttributeError from the header's ``.items()``)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    header = b"[]" + b" " * 6
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(UserError) as err:
        hf_source.open_folder(str(tmp_path))
    assert str(err.value) == (f"model.init_from {tmp_path}: model.safetensors is not a safetensors file "
                              "(its header is not JSON)")
