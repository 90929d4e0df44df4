"""`podtrain plan` / `podtrain report`: the arithmetic against hand-computed values, the exact
peak table, the command's one-line errors, and the report on runs slowed on purpose."""

import json

import pytest

from multirank import run_ranks

from podtrain.cli import main
from podtrain.config import dump_config, load_config
from podtrain.launch.instances import INSTANCE_TYPES
from podtrain.observe.hardware import PEAK_FLOPS, gpu_peak_flops
from podtrain.plan.machine import GPU_MEMORY_BANDWIDTH, instance_machine
from podtrain.plan.memory import (CPU_RESERVE_BYTES, ModelShape, activation_bytes, largest_micro_batch,
                                  memory_items, task_eval_bytes)
from podtrain.plan.planner import make_plan
from podtrain.plan.steptime import COLLECTIVE_HOP_S, exposed_s, ring_allreduce_s, ring_gather_s

# A model small enough to count by hand: 2 blocks, h=8, 2 heads of 4, 1 kv head, MLP 16, vocab 50.
SHAPE = ModelShape(params=1000, embedding_params=100, matmul_params=1000, flops_per_token=6000.0,
                   layers=2, hidden=8, attn_width=8, kv_width=4, heads=2, intermediate=16, vocab=50,
                   gated_mlp=True, rotary=True)


def test_memory_items_match_hand_computed_values():
    # Per token per block, fp32: norms 4h=32, q,k,v 8+2*4=16, attention out 8, rotary q,k 8+4=12,
    # gated MLP 4*16=64 -> 132 values x 4 bytes = 528. After the blocks: final norm 2*8*4=64 and
    # logits 50 x (4 + 8 fp32 loss copies) = 600 -> 664. 3 x 10 tokens.
    ddp = memory_items(SHAPE, "ddp", shards=1, micro_batch=3, seq_len=10, dtype_bytes=4,
                       checkpointing=False, gpu=False)
    assert (ddp.weights, ddp.gradients, ddp.optimizer, ddp.buffers) == (4000, 4000, 8000, 0)
    assert ddp.activations == 30 * (2 * 528 + 664) == 51600
    assert ddp.reserve == CPU_RESERVE_BYTES and ddp.total == 16000 + 51600 + CPU_RESERVE_BYTES
    # Checkpointing keeps each block's input (2 x 8 x 4 bytes) plus one block recomputed.
    assert activation_bytes(SHAPE, 3, 10, 4, checkpointing=True) == 30 * (64 + 528 + 664) == 37680
    # Separate DDP buckets (no bucket view) add a gradient copy; bf16 autocast adds 2 bytes per
    # matmul weight and halves the activations' dtype.
    assert memory_items(SHAPE, "ddp", 1, 3, 10, 4, False, False, bucket_view=False).buffers == 4000
    bf16 = memory_items(SHAPE, "ddp", 1, 3, 10, 2, False, True)
    assert bf16.buffers == 2000 and bf16.activations == 30 * (2 * 264 + (32 + 50 * 10))
    # FSDP over 4 ranks: state / 4; two gathered blocks of (1000-100)/2 = 450 params, fp32 weights
    # and gradients.
    fsdp = memory_items(SHAPE, "fsdp", shards=4, micro_batch=3, seq_len=10, dtype_bytes=4,
                        checkpointing=False, gpu=False)
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer, fsdp.buffers) == (1000, 1000, 2000, 7200)
    # Eager attention keeps scores and probabilities: 2 heads x seq_len x 2 per token per block.
    eager = activation_bytes(SHAPE, 3, 10, 4, checkpointing=False, eager_attention=True)
    assert eager - ddp.activations == 30 * 2 * (2 * 2 * 10) * 4


def test_task_evaluation_memory_is_counted_and_refuses_a_run_it_would_not_fit(repo):
    from podtrain.errors import UserError
    from podtrain.plan.fit import Devices, check_memory
    from podtrain.plan.shape import model_shape

    # Per token, fp32: KV caches of 2 blocks, twice (a context's beside its copies) 2 x 2 x 2 x 4 x 4
    # = 128; one block's values 528; the scored log-probabilities 664. 3 x 10 tokens.
    assert task_eval_bytes(SHAPE, 3, 10, 4) == 30 * (128 + 528 + 664) == 39600
    with_tasks = memory_items(SHAPE, "ddp", 1, 3, 10, 4, checkpointing=True, gpu=False, task_eval=True)
    without = memory_items(SHAPE, "ddp", 1, 3, 10, 4, checkpointing=True, gpu=False)
    assert (without.activations, without.task_eval) == (37680, 0)  # a checkpointed step keeps less
    assert (with_tasks.activations, with_tasks.task_eval) == (39600, 39600)
    assert memory_items(SHAPE, "ddp", 1, 3, 10, 4, False, False, task_eval=True).activations == 51600
    # The memory check at start: room for the steps but not for the evaluation's caches is refused.
    overrides = ["train.activation_checkpointing=full", "train.micro_batch_size=8", "train.global_batch_size=8"]
    cfg = _demo_cfg(repo, *overrides)
    step = check_memory(cfg, model_shape(cfg), Devices("one GPU", 1, 0, True), 1).fits[0].memory_ac
    device = Devices("one mocked GPU", 1, step.total, True)
    assert check_memory(cfg, model_shape(cfg), device, 1).strategy == "ddp"
    tasks = _demo_cfg(repo, *overrides, "eval.tasks=[podtrain-next-line]")
    with pytest.raises(UserError, match="needs .* GiB per device"):
        check_memory(tasks, model_shape(tasks), device, 1)


def test_largest_micro_batch_is_exact():
    one = memory_items(SHAPE, "ddp", 1, 1, 10, 4, False, False)
    device = one.static + 10 * one.activations  # room for exactly ten sequences
    assert largest_micro_batch(one, one.activations, device) == 10
    assert largest_micro_batch(one, one.activations, device - 1) == 9
    assert largest_micro_batch(one, one.activations, one.static - 1) == 0


def test_ring_model_and_overlap():
    # AllReduce: 2(n-1)/n x bytes / busbw; AllGather: (n-1)/n x bytes / busbw.
    assert ring_allreduce_s(8e9, 8, 400) == pytest.approx(2 * 7 / 8 * 8e9 / 400e9)
    assert ring_gather_s(8e9, 8, 400) == pytest.approx(7 / 8 * 8e9 / 400e9)
    assert ring_allreduce_s(8e9, 1, 400) == 0.0
    # 4 buckets of 0.25 s behind 3 s of backward: only the last bucket waits.
    assert exposed_s(1.0, 3.0, 4) == pytest.approx(0.25)
    # Behind 0.4 s of backward only 0.3 s hides (3 of 4 buckets' worth of backward).
    assert exposed_s(1.0, 0.4, 4) == pytest.approx(0.7)


@pytest.mark.parametrize("name, model", [
    ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA A100 80GB PCIe", "A100 80GB"),
    ("NVIDIA A10G", "A10G"), ("NVIDIA B200", "B200"),
])
def test_peak_lookup_is_exact(name, model):
    assert gpu_peak_flops(name, "bf16") == PEAK_FLOPS[(model, "bf16")]
    assert gpu_peak_flops(name, "fp32") == PEAK_FLOPS[(model, "fp32")]


def test_peak_lookup_does_not_match_substrings():
    assert gpu_peak_flops("NVIDIA L40", "bf16") is None  # an L40 is not an L4 (nor an L40S)
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bf16") < gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert gpu_peak_flops("NVIDIA H100 NVL", "bf16") < gpu_peak_flops("NVIDIA H100 SXM5 80GB", "bf16")
    assert gpu_peak_flops("Tesla T4", "bf16") is None
    # Every instance preset names a GPU the tables know.
    for inst in INSTANCE_TYPES.values():
        assert (inst.gpu_model, "bf16") in PEAK_FLOPS and inst.gpu_model in GPU_MEMORY_BANDWIDTH


def test_attention_flops_use_heads_times_head_dim():
    from transformers import LlamaConfig

    from podtrain.model import attention_width

    # Qwen3-style: 6 heads of 128 on a 192-wide residual: the scores are 768 wide, not 192.
    config = LlamaConfig(hidden_size=192, num_attention_heads=6, head_dim=128)
    assert attention_width(config) == 768
    assert attention_width(LlamaConfig(hidden_size=192, num_attention_heads=6)) == 192


def _demo_cfg(repo, *overrides):
    return load_config(str(repo / "configs/demo.yaml"), ["data.path=/nonexistent", *overrides])


def test_plan_on_p5_prices_time_and_scaling(repo):
    from podtrain.launch.instances import ON_DEMAND_USD_PER_HOUR
    from podtrain.plan.shape import model_shape

    cfg = _demo_cfg(repo, "train.global_batch_size=256")
    shape = model_shape(cfg)
    plan = make_plan(cfg, shape, instance_machine("p5.48xlarge", "auto", None, None), 2, None)
    assert plan.world == 16 and plan.precision == "bf16" and plan.strategy == "ddp"
    assert plan.tokens == 20 * shape.params
    assert plan.tokens_per_step == 256 * 256  # global batch x seq_len, 2 micro-batches per rank
    assert plan.cost_usd == pytest.approx(ON_DEMAND_USD_PER_HOUR["p5.48xlarge"] * 2
                                          * plan.seconds_to_tokens / 3600)
    # compute = FLOPs of 2 x 8 x 256 tokens / (989 TFLOP/s x 0.40)
    assert plan.time.compute_s == pytest.approx(shape.flops_per_token * 4096 / (989e12 * 0.40))
    # Two nodes all-reduce fp32 gradients over the network: 3200 Gbps = 400 GB/s.
    # (one bucket: the tiny model's 7 MB of gradients; 2 x log2(16) hops of latency)
    assert plan.time.comm_s == pytest.approx(ring_allreduce_s(4 * shape.params, 16, 400)
                                             + 2 * 4 * COLLECTIVE_HOP_S)
    assert [r["nodes"] for r in plan.scaling] == [2 ** i for i in range(11)]
    assert all(r["comm_exceeds_compute"] == (r["comm_s"] > r["compute_s"]) for r in plan.scaling)


def _cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_plan_bad_input_is_one_line_exit_2(repo, capsys):
    demo = str(repo / "configs/demo.yaml")
    code, out = _cli(capsys, "plan", demo, "--instance-type", "p5.48xlarg")
    assert code == 2 and out.err.count("\n") == 1 and "did you mean p5.48xlarge" in out.err
    code, out = _cli(capsys, "plan", demo, "--nodes", "0")
    assert code == 2 and out.err.count("\n") == 1 and "--nodes" in out.err
    # Llama 8B at 65,536 tokens per sequence: the logits alone outgrow a 24 GB A10G at any scale.
    code, out = _cli(capsys, "plan", demo, "--instance-type", "g5.8xlarge", "model.preset=llama-8b",
                     "data.seq_len=65536", "train.micro_batch_size=1", "data.path=/nonexistent")
    assert code == 2 and out.err.count("\n") == 1 and "not even fsdp over 1024 nodes" in out.err


def test_plan_json_chooses_fsdp_when_ddp_cannot_fit(repo, capsys):
    code, out = _cli(capsys, "plan", str(repo / "configs/demo.yaml"), "--json", "--instance-type",
                     "p5.48xlarge", "model.preset=llama-8b", "data.seq_len=4096",
                     "train.micro_batch_size=1", "train.global_batch_size=8", "data.path=/nonexistent")
    assert code == 0, out.err
    plan = json.loads(out.out)
    by = {s["strategy"]: s for s in plan["strategies"]}
    assert by["ddp"]["max_micro_batch"] == 0  # 16 bytes x 8B params > 80 GB
    assert plan["strategy"] in ("hsdp", "fsdp") and by[plan["strategy"]]["max_micro_batch"] >= 1
    # The config asks for the default ddp: the plan says it does not fit and what to set instead.
    assert plan["note"] == ("the config's dist.strategy=ddp with train.activation_checkpointing=none does "
                            f"not fit at train.micro_batch_size=1: set dist.strategy={plan['strategy']} "
                            "train.activation_checkpointing=none")
    # Asked for fsdp, the plan keeps it (it fits) and has nothing to say.
    code, out = _cli(capsys, "plan", str(repo / "configs/demo.yaml"), "--json", "--instance-type",
                     "p5.48xlarge", "model.preset=llama-8b", "data.seq_len=4096", "dist.strategy=fsdp",
                     "train.micro_batch_size=1", "train.global_batch_size=8", "data.path=/nonexistent")
    assert code == 0 and json.loads(out.out)["strategy"] == "fsdp" and json.loads(out.out)["note"] is None
    # hsdp on one node is fsdp: named so, and nothing to correct.
    code, out = _cli(capsys, "plan", str(repo / "configs/demo.yaml"), "--json", "--instance-type",
                     "p5.48xlarge", "model.preset=llama-8b", "data.seq_len=4096", "dist.strategy=hsdp",
                     "train.micro_batch_size=1", "train.global_batch_size=8", "data.path=/nonexistent")
    assert code == 0 and json.loads(out.out)["strategy"] == "fsdp" and json.loads(out.out)["note"] is None


def _train_rank(rank, world, config, overrides):
    from podtrain.config import load_config
    from podtrain.train.loop import train

    return train(load_config(config, overrides)).step


def _slowed_run(repo, tmp_path, data, fault, monkeypatch):
    """An 8-step 2-rank run with ``fault`` (real ranks: forked processes over gloo running the
    training loop, the fault patched in before they fork), then its report."""
    from fault_plugin.podtrain_faults import install  # tests/ is on sys.path (conftest)
    from podtrain.plan.report import build_report

    install(fault, patch=monkeypatch.setattr)
    run_dir = tmp_path / "run"
    overrides = [f"data.path={data}", f"run.dir={run_dir}", "data.seq_len=64", "train.micro_batch_size=4",
                 "train.global_batch_size=8", "train.steps=8", "log.every=4", "monitor.straggler_every=4",
                 "eval.every=0", "ckpt.every=0", "log.progress=off", "log.trackers=none", "data.verify=false"]
    assert run_ranks(_train_rank, 2, str(repo / "configs/demo.yaml"), overrides, timeout=240) == [8, 8]
    return build_report(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("fault, furthest", [
    # 1 s, not 0.4: the loader builds ahead while the step computes, so the wait is the sleep less the
    # step's compute, and on a loaded machine (the suite's 3 workers on 2 cores) compute itself ran
    # ~0.3 s over its prediction and came out furthest.
    ("slow-loader:seconds=1.0", "data wait"),
    ("slow-step:rank=1,seconds=0.4", "sync wait"),
])
def test_report_names_what_was_slowed(repo, tmp_path, builtin_corpus, fault, furthest, monkeypatch):
    report = _slowed_run(repo, tmp_path, builtin_corpus, fault, monkeypatch)
    assert report["furthest"] == furthest, report
    if furthest == "sync wait":  # rank 0 waits; the straggler fields name the slow rank
        assert report["straggler"]["rank"] == 1 and "slow rank 1" in report["verdict"]


def test_report_of_a_plain_run_dir_is_one_line_error(tmp_path, capsys):
    code, out = _cli(capsys, "report", str(tmp_path))
    assert code == 2 and out.err.count("\n") == 1 and "metrics.jsonl" in out.err


def test_report_reads_the_split_from_metrics(repo, tmp_path):
    from podtrain.plan.report import measured_split

    dump_config(_demo_cfg(repo), tmp_path / "config.yaml")
    base = {"kind": "train", "world_size": 2, "step_time_s": 1.0, "data_wait_s": 0.1, "sync_wait_s": 0.2}
    lines = [dict(base, step=10), dict(base, step=20, step_time_s=0.5, data_wait_s=0.05),
             {"kind": "save", "step": 20, "save_s": 2.0}, {"kind": "eval", "step": 20, "eval_s": 4.0}]
    got = measured_split(lines)
    # The first interval (start-up) is left out; saves and evals amortise over 20 steps.
    assert got["step_s"] == 0.5 and got["data wait"] == 0.05 and got["sync wait"] == 0.2
    assert got["compute"] == pytest.approx(0.25)
    assert got["saves"] == 0.1 and got["evaluation"] == 0.2 and got["goodput"] is None
    # Rank 1 waited 0.15 s longer for data, and rank 0 waited for it in the sync: data wait.
    lines[1].update(data_wait_by_rank=[0.05, 0.2])
    got = measured_split(lines)
    assert got["data wait"] == 0.2 and got["sync wait"] == pytest.approx(0.05)


def test_busbw_json_gives_bandwidth_by_message_size(tmp_path):
    from podtrain.errors import UserError
    from podtrain.plan.machine import with_busbw_json

    path = tmp_path / "busbw.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"op": "all_reduce", "bytes": 1 << 20, "busbw_gbps": 2.0},
        {"op": "all_reduce", "bytes": 64 << 20, "busbw_gbps": 9.0},
        {"op": "broadcast", "bytes": 64 << 20, "busbw_gbps": 50.0}]))
    machine = with_busbw_json(instance_machine("p4d.24xlarge", "bf16", None, None), str(path))
    assert machine.busbw_gbps(4, 32 << 20) == 2.0  # the largest measured size not above 32 MiB
    assert machine.busbw_gbps(4, 1 << 30) == 9.0 and machine.busbw_gbps(4, 1024) == 2.0
    path.write_text(json.dumps({"op": "broadcast", "bytes": 1, "busbw_gbps": 1.0}) + "\n")
    with pytest.raises(UserError, match="no all_reduce records"):
        with_busbw_json(machine, str(path))


@pytest.mark.parametrize("preset, instance, overrides, unsharded", [
    # 8B on 8 x 80 GiB: shards 15 GiB, the gathered model 45 GiB, 4096-token activations ~30 GiB.
    ("llama-8b", "p5.48xlarge", ("data.seq_len=4096",), False),
    # The same on 141 GiB H200s: keeping the weights gathered fits.
    ("llama-8b", "p5e.48xlarge", ("data.seq_len=4096",), True),
    # The same on 80 GiB with short sequences: the activations no longer push it over.
    ("llama-8b", "p5.48xlarge", ("data.seq_len=128",), True),
    ("llama-1b", "g5.48xlarge", ("data.seq_len=2048", "train.activation_checkpointing=full"), True),
    ("llama-1b", "g5.48xlarge", ("data.seq_len=2048", "train.micro_batch_size=4",
                                 "train.global_batch_size=64", "train.activation_checkpointing=full"), False),
])
def test_plan_and_the_run_decide_the_same_fsdp_accumulation_on_mocked_gpus(
        repo, tmp_path, monkeypatch, preset, instance, overrides, unsharded):
    """One decision (plan.fit.accumulates_unsharded): what `plan` prints is what every rank's
    preflight (device memory mocked: no GPU here) gives the strategy, whose start-up line says it."""
    import torch

    import podtrain.train.preflight as preflight
    from synthetic_data import make_data_dir
    from podtrain.launch.instances import lookup
    from podtrain.plan.render import render_plan
    from podtrain.plan.shape import model_shape
    from podtrain.train.strategy import FSDPStrategy

    inst = lookup(instance)
    monkeypatch.setattr(preflight, "device_memory_bytes", lambda device, local: (
        2**41 if device.type == "cpu" else int(inst.gpu_memory_gib * 2**30)))  # mocked GPUs, 2 TiB host
    data = make_data_dir(tmp_path / "data", shard_tokens=(20000,), val_tokens=600)
    cfg = load_config(str(repo / "configs/demo.yaml"), [
        f"data.path={data}", f"model.preset={preset}", "model.vocab_size=128256", "dist.strategy=fsdp",
        "train.micro_batch_size=1", "train.global_batch_size=16", "eval.every=0", *overrides])
    plan = make_plan(cfg, model_shape(cfg), instance_machine(instance, "auto", None, None), 1, None)
    checked = preflight.check_run(cfg, inst.gpus, inst.gpus, torch.device("cuda", 0))
    assert plan.strategy == "fsdp" and plan.note is None
    assert plan.accumulate_unsharded == checked.accumulate_unsharded == unsharded
    started = FSDPStrategy("fsdp", (inst.gpus,), None, None, checked.accumulate_unsharded).describe()
    assert f"gradient accumulation {plan.accumulation}" in render_plan(plan)
    assert started.endswith(f"gradient accumulation {plan.accumulation}")


def test_plan_prints_the_vocabulary_and_batch_it_used_and_refuses_a_batch_the_launchers_refuse(
        repo, tmp_path, capsys):
    from synthetic_data import make_data_dir

    demo = str(repo / "configs/demo.yaml")
    code, out = _cli(capsys, "plan", demo, "--instance-type", "g5.12xlarge", "data.path=/nonexistent",
                     "train.global_batch_size=32")
    assert code == 0, out.err
    assert "with the preset's own vocabulary (320)" in out.out
    assert "vocabulary: /nonexistent has no prepared data here; model.vocab_size=N plans another" in out.out
    assert ("batch: global 32 sequences = micro-batch 8 x 1 accumulation step(s) x 4 rank(s); "
            "8,192 tokens per step") in out.out
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    code, out = _cli(capsys, "plan", demo, "--instance-type", "g5.8xlarge", f"data.path={data}")
    assert code == 0 and (f"vocabulary: the same as {data}'s byte-level tokenizer (257 ids, rounded up "
                          "to 64)") in out.out, out.err
    # 32 sequences over 8 GPUs x micro-batch 8: `launch slurm` refuses it, so does plan (same check).
    for argv in (["plan", demo, "--instance-type", "p5.48xlarge"],
                 ["launch", "slurm", demo, "--instance-type", "p5.48xlarge", "--nodes", "1"]):
        code, out = _cli(capsys, *argv, "data.path=/nonexistent", f"run.dir={tmp_path / 'run'}",
                         "train.global_batch_size=32")
        assert code == 2 and out.err.count("\n") == 1, out.err
        assert ("train.global_batch_size=32 is not divisible by train.micro_batch_size x world size = "
                "8 x 8 = 64") in out.err
