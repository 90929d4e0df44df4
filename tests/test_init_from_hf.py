"""``model.init_from``: continuing pre-training from a Hugging Face model folder.

The folders are small Qwen2 (tied embeddings, saved in bf16) and Llama (untied, fp32) models built
here by transformers and written by ``save_pretrained`` with a small ``max_shard_size``, so an index
and several shards exist. The loads run on real forked gloo ranks (``tests/multirank.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
# Imported once here, not in each forked rank (DTensor, FSDP and DCP take seconds to import).
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401

from multirank import gloo_context, run_ranks
from podtrain.cli import main
from synthetic_data import make_data_dir

IDS = torch.arange(48).reshape(2, 24) * 7 % 300


def _save(root: Path, model_type: str, tied: bool, dtype: torch.dtype) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                  max_position_embeddings=256, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # weights far from any initialisation podtrain could make itself
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root, max_shard_size="60KB", safe_serialization=True)
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Two sharded HF folders: ``qwen2`` (tied, bf16) and ``llama`` (untied, fp32)."""
    root = tmp_path_factory.mktemp("hf")
    out = {"qwen2": _save(root / "qwen2", "qwen2", True, torch.bfloat16),
           "llama": _save(root / "llama", "llama", False, torch.float32)}
    for path in out.values():
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("model-*"))) >= 3
    return out


def _reference_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def _load_on_rank(rank, world, folder, strategy):
    """podtrain's model built from the folder's config, wrapped by ``strategy``, loaded from it."""
    from podtrain.ckpt.hf_source import load_folder
    from podtrain.model import build_model, init_config
    from podtrain.train.precision import resolve_precision
    from podtrain.train.strategy import FSDPStrategy, build_for_strategy

    ctx = gloo_context()
    config = init_config(folder, None, {"vocab_size": 257}, "data")
    if strategy == "ddp":  # as the loop builds them under model.init_from: no random initialisation
        net = build_model(config, seed=11, init="zeros")
    else:  # rank 0's whole copy gives its buffers only; the weights come from the folder
        net, reference = build_for_strategy(config, "sdpa", 11, strategy, ctx, random_init=False)
        shape = (world,) if strategy == "fsdp" else (2, world // 2)  # hsdp: replicas x shard
        fsdp = FSDPStrategy(strategy, shape, ctx, resolve_precision("fp32", ctx.device), True)
        fsdp.fill_weights = False
        fsdp.wrap(net, reference)
    optimizer = torch.optim.AdamW(net.parameters())
    stats = load_folder(folder, net, optimizer, ctx)
    tied = net.get_output_embeddings().weight is net.get_input_embeddings().weight
    with torch.no_grad():
        logits = net.eval()(IDS).logits
    return stats.bytes_read, stats.folder.nbytes, logits, tied, len(optimizer.state)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_equal_from_pretrained_on_two_ranks(folders, arch, strategy):
    want = _reference_logits(folders[arch])
    results = run_ranks(_load_on_rank, 2, str(folders[arch]), strategy, timeout=90)
    total = results[0][1]
    for read, _, logits, tied, optim_state in results:
        assert (logits - want).abs().max().item() <= 1e-5
        assert tied == (arch == "qwen2")  # Qwen2's head stays the embedding; Llama's is its own
        assert optim_state == 0  # the optimizer starts fresh
    reads = [r[0] for r in results]
    if strategy == "ddp":  # the ranks split the reading: together exactly the folder, once
        assert sum(reads) == total and max(reads) < 0.6 * total
    else:  # each rank read its shards (merged reads may span a small gap between them)
        assert all(0 < r < total for r in reads)
    assert reads == _planned_reads(folders[arch], strategy, 2)  # `podtrain plan`'s figure is the load's own


def _planned_reads(folder: Path, strategy: str, world: int, shard: int | None = None) -> list[int]:
    """The bytes per rank ``podtrain plan`` counts for this load (``plan.init_load``)."""
    from podtrain.model import hf_folder_config
    from podtrain.plan.init_load import folder_tensors, rank_read_bytes

    tensors, _ = folder_tensors(str(folder), hf_folder_config(str(folder)))
    return rank_read_bytes(tensors, strategy, world, shard)


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_logits_equal_from_pretrained_on_four_ranks(folders, strategy):
    want = _reference_logits(folders["qwen2"])
    results = run_ranks(_load_on_rank, 4, str(folders["qwen2"]), strategy, timeout=120)
    assert all((logits - want).abs().max().item() <= 1e-5 and tied for _, _, logits, tied, _ in results)
    reads = [r[0] for r in results]
    # fsdp: every rank reads its quarter; hsdp: each replica group reads about half the tensors, its
    # shard of them (the other group receives them): either way about a quarter of the folder each.
    assert all(0 < r < 0.5 * results[0][1] for r in reads), reads
    assert reads == _planned_reads(folders["qwen2"], strategy, 4, 2 if strategy == "hsdp" else None)


def _train(rank, world, repo, run_dir, data, overrides):
    from podtrain.config import load_config
    from podtrain.distributed.env import ClusterEnv
    from podtrain.train import loop

    cfg = load_config(str(Path(repo) / "configs/demo.yaml"), [
        f"run.dir={run_dir}", f"data.path={data}", "train.micro_batch_size=2", "train.global_batch_size=4",
        "data.seq_len=32", "optim.warmup_steps=0", "eval.every=0", "ckpt.every=1", "log.every=1",
        "log.progress=off", "monitor.watchdog=false", "monitor.straggler_every=0", "data.verify=false",
        *overrides])
    result = loop.train(cfg, ClusterEnv.detect())
    return result.step, result.exit_code


@pytest.mark.parametrize("arch,strategy", [("qwen2", "ddp"), ("llama", "fsdp")])
def test_first_step_loss_equals_a_bare_pytorch_step_from_from_pretrained(folders, tmp_path, repo, arch, strategy):
    """Step 1's logged loss and gradient norm (2 ranks) are those of one plain PyTorch forward and
    backward of ``from_pretrained``'s fp32 model on the same global batch. Tolerance: 1e-5
    relative (fp32; the ranks' partial sums are added in another order than one process's)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from podtrain.config import load_config
    from podtrain.data.loader import ShardedLoader

    folder = folders[arch]  # qwen2: tied, bf16 in the folder (the head's gradient is the embedding's too)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,))
    run_dir = tmp_path / "run"
    assert run_ranks(_train, 2, str(repo), str(run_dir), str(data),
                     [f"model.init_from={folder}", "train.steps=1", f"dist.strategy={strategy}"],
                     timeout=120)[0] == (1, 0)
    logged = next(m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                  if m.get("step") == 1 and "loss" in m)
    # The global batch of step 1 as the loader builds it: on one rank, its slice is the whole
    # batch (rank 0's micro-batches, then rank 1's), in the run's data order (run.seed).
    seed = load_config(str(repo / "configs/demo.yaml"), []).run.seed
    loader = ShardedLoader(data, 32, 4, 2, rank=0, world_size=1, seed=seed)
    try:
        rows = torch.cat(loader.build(0).micro_batches)
    finally:
        loader.close()
    assert rows.shape == (4, 33)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    logits = model(input_ids=rows[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=0)
    assert logged["grad_norm"] == pytest.approx(norm.item(), rel=1e-5, abs=0)


@pytest.mark.slow
def test_export_of_an_unchanged_run_is_the_folder_and_a_resume_uses_its_own_checkpoint(folders, tmp_path, repo):
    from safetensors.torch import load_file

    src = tmp_path / "qwen2"
    shutil.copytree(folders["qwen2"], src)
    texts = _corpus(tmp_path / "corpus")
    _tokenizer(texts, src / "tokenizer.json")  # the folder's own tokenizer: 300 ids, its embedding 320
    data = tmp_path / "data"
    assert main(["prepare", str(tmp_path / "corpus"), "--out", str(data), "--tokenizer", str(src)]) == 0
    run_dir = tmp_path / "run"
    # One step at optim.lr=0 changes no weight (AdamW's update and decay both scale with the LR).
    assert run_ranks(_train, 2, str(repo), str(run_dir), str(data),
                     [f"model.init_from={src}", "train.steps=1", "optim.lr=0", "optim.min_lr=0"],
                     timeout=120)[0] == (1, 0)
    recorded = json.loads((run_dir / "lineage.json").read_text())["parent"]
    from podtrain.ckpt.hf_source import open_folder

    assert recorded == {"init_from": str(src), "sha256": open_folder(str(src)).sha256, "step": 0}
    manifest = json.loads((run_dir / "ckpt" / "step_000001" / "manifest.json").read_text())
    assert manifest["parent"]["init_from"] == str(src)  # every checkpoint of the run carries it
    out = tmp_path / "export"
    assert main(["export", str(run_dir), str(out)]) == 0
    given = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        given.update(load_file(shard))
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(given) and "lm_head.weight" not in exported  # tied: saved once
    for name, tensor in given.items():
        assert torch.equal(exported[name], tensor.float()), name  # bf16 -> fp32, bit for bit
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text = texts[0][:200] + " unseen wörds"
    assert AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False) == \
        Tokenizer.from_file(str(src / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    # The run trains on: it resumes from its own step 1, never from the folder (whose weights are gone).
    for shard in src.glob("model-*.safetensors"):
        shard.unlink()
    assert run_ranks(_train, 2, str(repo), str(run_dir), str(data),
                     [f"model.init_from={src}", "train.steps=2", "optim.lr=1e-3"], timeout=120)[0] == (2, 0)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]


def _corpus(root: Path) -> list[str]:
    import random

    rng = random.Random(0)
    words = ["def", "class", "return", "import", "for", "while", "print", "self", "value", "model"]
    root.mkdir()
    texts = ["\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)) for _ in range(4)]
    for i, text in enumerate(texts):
        (root / f"f{i}.txt").write_text(text)
    return texts


def _tokenizer(texts: list[str], path: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` of 300 ids, as a model folder ships it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def _bad(folder: Path, case: str) -> str:
    """Spoil a copy of a good folder as ``case`` says; returns the words its error line must hold."""
    from safetensors.torch import load_file, save_file

    shards = sorted(folder.glob("model-*.safetensors"))
    if case == "no weights":
        for f in [*shards, folder / "model.safetensors.index.json"]:
            f.unlink()
        return "no weights"
    if case == "missing shard":
        shards[1].unlink()
        return f"{shards[1].name}, named by model.safetensors.index.json, is missing"
    if case == "pickle":
        for f in [*shards, folder / "model.safetensors.index.json"]:
            f.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
        return "pytorch_model.bin, a pickle checkpoint"
    if case == "unknown architecture":
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="llamazilla", architectures=["LlamazillaForCausalLM"])
        (folder / "config.json").write_text(json.dumps(config))
        return "model_type='llamazilla' (LlamazillaForCausalLM) is not a causal LM transformers"
    if case == "shape":
        shard = next(f for f in shards if "model.norm.weight" in load_file(f))
        tensors = load_file(shard)
        tensors["model.norm.weight"] = torch.ones(65)
        save_file(tensors, shard, metadata={"format": "pt"})
        return "tensor model.norm.weight is [65]"
    raise AssertionError(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no weights", "missing shard", "pickle", "unknown architecture", "shape"])
def test_a_bad_folder_is_one_line_and_exit_2(folders, tmp_path, repo, capsys, case):
    bad = tmp_path / "bad"
    shutil.copytree(folders["llama"], bad)
    words = _bad(bad, case)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,))
    capsys.readouterr()
    code = main(["train", str(repo / "configs/demo.yaml"), f"run.dir={tmp_path / 'run'}", f"data.path={data}",
                 f"model.init_from={bad}", "train.steps=1", "train.micro_batch_size=2",
                 "train.global_batch_size=2", "data.seq_len=32", "eval.every=0", "log.progress=off",
                 "monitor.watchdog=false", "data.verify=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("podtrain: error: ") and words in err[0], err
    assert not list((tmp_path / "run").glob("ckpt/step_*"))
    if case == "pickle":  # the line says how transformers converts it
        assert "save_pretrained(" in err[0] and "safe_serialization=True" in err[0]


def test_a_tokenizer_or_vocabulary_other_than_the_folders_is_refused(folders, tmp_path):
    from podtrain.errors import UserError
    from podtrain.model import init_config

    folder = tmp_path / "with_tokenizer"
    shutil.copytree(folders["llama"], folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    import hashlib

    own = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    assert init_config(str(folder), None, {"sha256": own, "vocab_size": 300}, "d").vocab_size == 320
    with pytest.raises(UserError) as exc:
        init_config(str(folder), None, {"name": "byte", "sha256": "ab" * 32, "vocab_size": 257}, "DATA")
    line = str(exc.value)
    assert "\n" not in line and "DATA" in line and "byte" in line and str(folder) in line
    assert f"podtrain prepare INPUT... --tokenizer {folder}" in line
    with pytest.raises(UserError, match=r"50000 tokens, more than the embedding .* \(320\)"):
        init_config(str(folders["llama"]), None, {"name": "big", "vocab_size": 50000}, "DATA")
    with pytest.raises(UserError, match="model.vocab_size=384"):
        init_config(str(folders["llama"]), 384, {"vocab_size": 257}, "DATA")


def test_a_folder_on_s3_gives_the_same_weights(folders, s3_bucket):
    from podtrain.ckpt.hf_source import load_folder
    from podtrain.model import build_model, init_config
    from podtrain.storage import open_store

    url = f"s3://{s3_bucket}/models/qwen2"
    store = open_store(url)
    for f in folders["qwen2"].iterdir():
        store.write_bytes(f.name, f.read_bytes())
    net = build_model(init_config(url, None, {"vocab_size": 257}, "data"), seed=2)
    stats = load_folder(url, net, torch.optim.AdamW(net.parameters()), gloo_context())
    assert stats.bytes_read == stats.folder.nbytes
    with torch.no_grad():
        assert (net.eval()(IDS).logits - _reference_logits(folders["qwen2"])).abs().max().item() <= 1e-5


def test_plan_counts_the_folders_model(folders, repo, capsys):
    from transformers import AutoModelForCausalLM

    want = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folders["llama"]).parameters())
    capsys.readouterr()
    assert main(["plan", str(repo / "configs/demo.yaml"), f"model.init_from={folders['llama']}",
                 "train.global_batch_size=64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["params"] == want == 102720  # the folder's untied 320-token Llama, not the tiny preset
    assert "320" in json.dumps(plan["vocab"])
    assert plan["init_load"]["bytes_per_rank_max"] > 0
    assert main(["plan", str(repo / "configs/demo.yaml"), f"model.init_from={folders['llama']}",
                 "train.global_batch_size=64"]) == 0
    loads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("load: model.init_from")]
    assert len(loads) == 1 and "each rank reads at most" in loads[0], loads


def test_plan_counts_the_load_per_rank_and_its_time(folders, repo):
    """``plan.init_load`` on 2 nodes of 8 GPUs: the folder is read once in all, ~1/16 per rank,
    whatever the strategy; ddp then receives the rest of the fp32 model, hsdp the other replica
    group's shards, fsdp nothing; the time is the busiest node's reads plus that exchange."""
    from podtrain.config import load_config
    from podtrain.plan.init_load import READ_BYTES_PER_S_PER_NODE, init_load
    from podtrain.plan.machine import instance_machine

    folder = str(folders["llama"])  # fp32 in the folder: its bytes are the fp32 model's
    cfg = load_config(str(repo / "configs/demo.yaml"), [f"model.init_from={folder}"])
    machine = instance_machine("p5.48xlarge", "bf16", None, None)
    fp32 = 102720 * 4
    received = {"ddp": fp32 - fp32 // 16, "fsdp": 0, "hsdp": fp32 // 8 // 2}
    for strategy in ("ddp", "fsdp", "hsdp"):
        load = init_load(cfg, strategy, 16, machine, 2)
        assert load.folder_bytes == fp32 and len(load.rank_bytes) == 16
        assert sum(load.rank_bytes) == fp32, strategy  # every byte read once, by one rank
        assert load.max_rank_bytes < 1.5 * fp32 / 16, (strategy, load.rank_bytes)
        assert load.max_node_bytes == max(sum(load.rank_bytes[:8]), sum(load.rank_bytes[8:]))
        assert load.exchange_bytes == received[strategy]
        busbw = machine.busbw_gbps(2, load.exchange_bytes) if load.exchange_bytes else 0.0
        assert load.seconds == pytest.approx(load.max_node_bytes / READ_BYTES_PER_S_PER_NODE
                                             + (load.exchange_bytes / (busbw * 1e9) if busbw else 0))
        line = load.line()
        assert "\n" not in line and f"{load.max_rank_bytes / 1e3:,.1f} kB" in line and strategy in line
        assert "2 GB/s per node (assumed)" in line and ("receiving" in line) == (strategy != "fsdp")
        assert load.as_dict()["bytes_per_rank_max"] == load.max_rank_bytes
