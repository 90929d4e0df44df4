"""Document masking (data.document_masking): attention inside each document, positions restarting.

Real parts throughout: hand-made token shards with known document boundaries, the real loader
(thread and worker process), the tiny Llama, and real `podtrain train` runs in this process. The
GPU path (flex_attention's BlockMask) is checked on the CPU by its forward: flex_attention runs
forward on a CPU, unfused; its backward needs a GPU.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from podtrain.cli import main
from podtrain.data import doc_mask
from podtrain.data.doc_mask import DocumentMasker, block_tables, document_ids
from podtrain.data.loader import ShardedLoader
from podtrain.errors import UserError
from podtrain.model import build_model, preset_config
from test_resume import losses

EOS = 256
VOCAB = 257


def make_docs_dir(root: Path, docs: list[list[int]], val_tokens: int = 200) -> Path:
    """A data directory whose train split is ``docs``, each followed by EOS (as prepare writes them)."""
    root.mkdir(parents=True, exist_ok=True)
    train = np.concatenate([np.asarray(d + [EOS]) for d in docs]).astype(np.uint16)
    val = (np.arange(val_tokens) % 200).astype(np.uint16)
    splits = {}
    for split, arr, n_docs in (("train", train, len(docs)), ("val", val, 1)):
        name = f"{split}_00000.bin"
        arr.tofile(root / name)
        splits[split] = {"tokens": len(arr), "documents": n_docs, "shards": [
            {"file": name, "tokens": len(arr), "documents": n_docs, "max_token_id": int(arr.max()),
             "sha256": hashlib.sha256(arr.tobytes()).hexdigest()}]}
    manifest = {"format": "podtrain-shards/1", "dtype": "uint16", "splits": splits,
                "tokenizer": {"kind": "byte", "name": "byte", "vocab_size": VOCAB, "eos_id": EOS, "files": []}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def random_docs(lengths: list[int], seed: int) -> list[list[int]]:
    """Documents of these lengths (EOS not counted) of random byte tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


# -- the loader carries the boundaries -----------------------------------------------------------
def test_the_loader_hands_each_sample_its_document_positions_and_mask(tmp_path):
    # Stream: [1 2 E][3 4 5 6 E][7 8 E][9 E]...; seq_len 8: sample 0 is the first 9 tokens.
    data = make_docs_dir(tmp_path / "data", [[1, 2], [3, 4, 5, 6], [7, 8], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18]])
    seen = {}
    for workers in (0, 1):  # the producer thread, and a worker process (its items cross a pipe)
        loader = ShardedLoader(data, seq_len=8, global_batch_size=2, micro_batch_size=1, rank=0, world_size=1,
                               seed=0, num_workers=workers, document_masks="bool")
        try:
            batch = loader.next()
        finally:
            loader.close()
        seen[workers] = {int(i): m for i, m in zip(batch.sample_ids, batch.micro_batches)}
    assert sorted(seen[0]) == [0, 1]
    first = seen[0][0]
    assert first.rows.tolist() == [[1, 2, EOS, 3, 4, 5, 6, EOS, 7]]
    assert first.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    mask = first.mask[0, 0].int().tolist()
    assert first.mask.shape == (1, 1, 8, 8) and first.mask.dtype == torch.bool
    assert mask[2] == [1, 1, 1, 0, 0, 0, 0, 0]  # the first EOS belongs to the document it ends
    assert mask[3] == [0, 0, 0, 1, 0, 0, 0, 0]  # the second document's first token sees only itself
    assert mask[7] == [0, 0, 0, 1, 1, 1, 1, 1]
    # Sample 1 = tokens 8..16: [7 8 E 9 E 10 11 12 | 13]: four documents, the last one partial.
    second = seen[0][1]
    assert second.rows.tolist() == [[7, 8, EOS, 9, EOS, 10, 11, 12, 13]]
    assert second.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert second.mask[0, 0, 4].int().tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    for i in (0, 1):  # the worker process hands over the same tensors
        for name in ("rows", "position_ids", "mask"):
            assert torch.equal(getattr(seen[1][i], name), getattr(seen[0][i], name)), (i, name)
    additive = DocumentMasker(EOS, "additive")(first.rows)
    assert additive.mask.dtype == torch.float32
    assert torch.equal(additive.mask == 0, first.mask)  # eager's form: 0 where allowed, very negative elsewhere


def test_flex_block_mask_tables_match_create_block_mask_and_the_dense_mask():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seq = 384
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 256, (3, seq + 1))
    rows[0, [5, 130, 131, 300]] = EOS  # documents across tile edges, one a single token
    rows[2, 255] = EOS  # a boundary exactly at a tile's end: the next tiles are full
    docs = document_ids(rows[:, :-1], EOS)
    d = torch.from_numpy(docs)
    ref = create_block_mask(lambda b, h, q, k: (d[b, q] == d[b, k]) & (q >= k), 3, None, seq, seq, device="cpu")
    ours = block_tables(docs)
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    for name, table in zip(names, ours):
        assert torch.equal(table, getattr(ref, name)), name
    # Row 2, known by hand: query tile 1 sees key tile 0 whole (one document), tile 2 a new
    # document: only its diagonal tile, partial as every diagonal tile is.
    assert ours[0][2, 0].tolist() == [1, 1, 1] and ours[2][2, 0].tolist() == [0, 1, 0]
    batch = DocumentMasker(EOS, "block")(torch.from_numpy(rows))
    q, k, v = torch.randn(3, 3, 2, seq, 16).unbind(0)
    out = flex_attention(q, k, v, block_mask=batch.attention_mask())  # unfused on a CPU: forward only
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=doc_mask.dense_mask(docs))
    assert (out - dense).abs().max().item() < 1e-5


# -- a document's logits do not depend on the one before it --------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    config = preset_config("tiny", VOCAB)
    config.num_hidden_layers = 2
    model = build_model(config, "sdpa", seed=0).eval()
    return model


def _logits(model, rows: torch.Tensor, masked: bool) -> torch.Tensor:
    with torch.no_grad():
        if not masked:
            return model(input_ids=rows[:, :-1]).logits
        batch = DocumentMasker(EOS, "bool")(rows)
        return model(input_ids=rows[:, :-1], position_ids=batch.position_ids,
                     attention_mask=batch.attention_mask()).logits


def test_a_documents_logits_do_not_depend_on_the_document_before_it(tiny_model):
    seq = 96
    rng = np.random.default_rng(7)
    doc = rng.integers(0, 256, 50).tolist() + [EOS]  # the document under test, its EOS included

    def sample(before: list[int]) -> torch.Tensor:
        tail = rng.integers(0, 256, seq + 1).tolist()  # whatever follows it: causality hides it
        return torch.tensor([(before + [EOS] + doc + tail)[:seq + 1]])

    at = {20: sample(rng.integers(0, 256, 20).tolist()),  # preceding document of 20 tokens + EOS
          21: sample(rng.integers(0, 256, 20).tolist()),  # another one of the same length
          9: sample(rng.integers(0, 256, 8).tolist())}    # a shorter one: the document starts earlier
    keys = [20, 21, 9]
    starts = {20: 21, 21: 21, 9: 9}
    masked = {k: _logits(tiny_model, at[k], True)[0, starts[k]:starts[k] + len(doc)] for k in keys}
    plain = {k: _logits(tiny_model, at[k], False)[0, starts[k]:starts[k] + len(doc)] for k in keys}
    for other in (21, 9):
        diff = (masked[20] - masked[other]).abs().max().item()
        assert diff <= 1e-6, (other, diff)
        # Not vacuous: without the mask the document sees its neighbour and sits elsewhere.
        assert (plain[20] - plain[other]).abs().max().item() > 1e-3


def test_a_sample_of_one_document_gets_the_unmasked_logits(tiny_model):
    rows = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 65)))
    rows[:, 64] = EOS  # an EOS as the last target changes nothing: no input token follows it
    diff = (_logits(tiny_model, rows, True) - _logits(tiny_model, rows, False)).abs().max().item()
    assert diff <= 1e-6, diff


# -- runs ------------------------------------------------------------------------------------------
BASE = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=6",
        "optim.warmup_steps=2", "eval.every=0", "log.every=1", "log.progress=off", "monitor.watchdog=false",
        "monitor.straggler_every=0", "data.verify=false", "ckpt.every=3", "ckpt.keep_last=0", "run.seed=3"]


def train(data: Path, run_dir: Path, *overrides: str) -> dict[int, float]:
    """A real `podtrain train` in this process; its per-step losses (the last record of a step)."""
    assert main(["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={run_dir}", *BASE, *overrides]) == 0
    return losses(run_dir)


@pytest.fixture
def in_repo(repo, monkeypatch):
    monkeypatch.chdir(repo)


def test_every_sample_one_document_trains_as_the_unmasked_run(tmp_path, in_repo):
    # Documents of 31 tokens + EOS = seq_len: sample i's inputs are document i exactly.
    data = make_docs_dir(tmp_path / "data", random_docs([31] * 40, seed=2))
    plain = train(data, tmp_path / "plain", "train.steps=3")
    masked = train(data, tmp_path / "masked", "train.steps=3", "data.document_masking=true")
    assert sorted(masked) == [1, 2, 3]
    for step in plain:
        assert masked[step] == pytest.approx(plain[step], rel=1e-6, abs=0), (step, masked, plain)


def test_resume_with_masking_gives_the_uninterrupted_losses(tmp_path, in_repo, monkeypatch):
    from podtrain.train import loop

    lengths = np.random.default_rng(5).integers(3, 40, 120).tolist()  # several documents per sample
    data = make_docs_dir(tmp_path / "data", random_docs(lengths, seed=6))
    whole = train(data, tmp_path / "whole", "data.document_masking=true")
    unmasked = train(data, tmp_path / "unmasked", "train.steps=1")
    assert abs(whole[1] - unmasked[1]) > 1e-4  # the mask is in the run: other losses than without it
    real = loop.Trainer._should_stop
    monkeypatch.setattr(loop.Trainer, "_should_stop", lambda self: self.progress.step == 4 or real(self))
    run = tmp_path / "resumed"
    assert main(["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={run}", *BASE,
                 "data.document_masking=true"]) != 0  # stopped after step 4 (a signal would)
    monkeypatch.setattr(loop.Trainer, "_should_stop", real)
    resumed = train(data, run, "data.document_masking=true")
    assert sorted(resumed) == list(range(1, 7))
    assert resumed == whole, (resumed, whole)


# -- refusals ------------------------------------------------------------------------------------
def test_what_cannot_mask_is_refused_in_one_line(tmp_path, in_repo, capsys):
    from transformers import AutoConfig

    from podtrain.config import load_config

    with pytest.raises(UserError, match="needs a GPU"):
        doc_mask.mask_kind("flex_attention", torch.device("cpu"), preset_config("tiny"))
    with pytest.raises(UserError, match="takes model.attn_implementation=flex_attention"):
        doc_mask.mask_kind("sdpa", torch.device("cuda"), preset_config("tiny"))  # no GPU used: only named
    with pytest.raises(UserError, match="sliding-window"):
        doc_mask.mask_kind("sdpa", torch.device("cpu"), AutoConfig.for_model("mistral", sliding_window=64))
    assert doc_mask.mask_kind("eager", torch.device("cpu"), preset_config("gpt2-124m")) == "additive"
    with pytest.raises(UserError, match="flash_attention_2 takes no document mask"):
        load_config("configs/demo.yaml", ["data.document_masking=true", "model.attn_implementation=flash_attention_2"])
    with pytest.raises(UserError, match="multiple of 128"):
        load_config("configs/demo.yaml", ["data.document_masking=true", "model.attn_implementation=flex_attention",
                                          "data.seq_len=200"])
    data = make_docs_dir(tmp_path / "data", random_docs([300] * 4, seed=1))
    code = main(["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={tmp_path / 'run'}", *BASE,
                 "data.seq_len=128", "data.document_masking=true",
                 "model.attn_implementation=flex_attention"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs a GPU" in err[0], err


# -- validation ----------------------------------------------------------------------------------
def test_validation_scores_each_document_as_training_sees_it(tmp_path, tiny_model):
    """Under data.document_masking the validation loss is the masked one: equal to scoring each
    document piece of a sample on its own (positions from 0), not the loss with attention across
    documents (which the model never trained with)."""
    import torch.nn.functional as F

    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.train.evaluate import evaluate_sources
    from podtrain.train.precision import resolve_precision

    lengths = np.random.default_rng(8).integers(3, 20, 60).tolist()
    data = make_docs_dir(tmp_path / "data", random_docs(lengths, seed=9))
    from podtrain.data.manifest import read_manifest
    from podtrain.data.samples import SampleIndex

    index = SampleIndex(read_manifest(data), "train", 32)  # the multi-document split, scored as validation
    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    precision = resolve_precision("fp32", ctx.device)
    masker = DocumentMasker(EOS, "bool")
    masked, _ = evaluate_sources(tiny_model, {"": index}, {"": 1.0}, ctx, 2, 3, precision, masker)
    plain, _ = evaluate_sources(tiny_model, {"": index}, {"": 1.0}, ctx, 2, 3, precision)

    from podtrain.data.samples import validation_ids

    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for row in index.gather(validation_ids(index.num_samples, 0, 1, 6)):
            inputs, targets = torch.from_numpy(row[:-1].astype(np.int64)), torch.from_numpy(row[1:].astype(np.int64))
            docs = document_ids(row[:-1][None], EOS)[0]
            for doc in np.unique(docs):
                piece = np.flatnonzero(docs == doc)
                logits = tiny_model(input_ids=inputs[piece][None]).logits[0]
                loss_sum += F.cross_entropy(logits.float(), targets[piece], reduction="sum").item()
                tokens += len(piece)
    assert masked == pytest.approx(loss_sum / tokens, rel=1e-5), (masked, loss_sum / tokens)
    assert abs(masked - plain) > 1e-3, (masked, plain)  # the unmasked score is another number
