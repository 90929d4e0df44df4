"""`podtrain plan`'s step time: the measured path (a real decoder layer, the LM head and loss, and the
optimizer timed on this host, ``plan/layertime.py``), and what it takes from published figures:
FP8's speed-up and document masking's cost (``plan/published.py``).

The config keys ``train.fp8`` and ``data.document_masking`` are read with getattr and a default by
the planner; the tests set them on the loaded config so that they run with or without the keys in
``config_sections.py``."""

import json
import math

import pytest

from podtrain.config import load_config
from podtrain.plan.machine import instance_machine, local_machine
from podtrain.plan.memory import ModelShape
from podtrain.plan.planner import make_plan
from podtrain.plan.steptime import Workload, ring_gather_s, step_time

# Small enough to time in well under a second a piece on one loaded core.
SMALL = ["data.path=/nonexistent", "data.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=4"]


def _cfg(repo, *overrides, fp8=None, masking=None):
    cfg = load_config(str(repo / "configs/demo.yaml"), [*SMALL, *overrides])
    if fp8 is not None:
        cfg.train.fp8 = fp8
    if masking is not None:
        cfg.data.document_masking = masking
    return cfg


def _measured_plan(repo, cfg, mean_document=None):
    from podtrain.plan.shape import model_config, model_shape

    shape = model_shape(cfg)
    machine = local_machine(2, None, None, shape, cfg.train.micro_batch_size, cfg.data.seq_len, cfg=cfg,
                            model_config=model_config(cfg, shape.vocab), mean_document=mean_document)
    return make_plan(cfg, shape, machine, 1, None, mean_document=mean_document)


def test_the_step_time_is_a_measured_decoder_layer_times_layers_plus_head_loss_and_optimizer(repo, capsys):
    from podtrain.cli import main

    code = main(["plan", str(repo / "configs/demo.yaml"), "--instance-type", "local", "--json", *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    step = json.loads(out)["step"]
    assert step["compute_path"] == "measured"
    timed = step["timed"]
    assert timed["timed"] == ["decoder_layer", "attention", "embedding_head_loss", "optimizer"]
    assert (timed["layers"], timed["micro_batch"], timed["timed_sequences"], timed["device"], timed["dtype"]) == (
        4, 2, 2, "cpu", "float32")
    assert 0 < timed["attention_s"] < timed["layer_s"] and timed["ends_s"] > 0 and timed["optimizer_layer_s"] > 0
    # One micro-batch per rank per step (4 = 2 x 2 ranks): compute = 4 layers + the ends, each as timed.
    assert step["compute_s"] == pytest.approx(4 * timed["layer_s"] + timed["ends_s"])
    assert step["attention_s"] == pytest.approx(4 * timed["attention_s"])
    assert step["other_s"] == pytest.approx(timed["ends_s"])
    assert step["optimizer_s"] == pytest.approx(4 * timed["optimizer_layer_s"] + timed["optimizer_ends_s"])


def test_a_shape_beyond_the_host_or_a_given_efficiency_takes_the_flop_path_and_says_so(repo):
    from podtrain.plan.layertime import measurable
    from podtrain.plan.shape import model_config, model_shape

    # Llama 3 70B's numbers (by hand: counting it costs seconds): a layer of one 2048-token sequence
    # is ~1.2e12 FLOPs, never timed here.
    big = ModelShape(params=70_553_706_496, embedding_params=525_336_576, matmul_params=70_028_369_920,
                     flops_per_token=4.3e11, layers=80, hidden=8192, attn_width=8192, kv_width=1024, heads=64,
                     intermediate=28672, vocab=128256, gated_mlp=True, rotary=True)
    assert "beyond the" in measurable(big, 2048)
    cfg = _cfg(repo)
    shape = model_shape(cfg)
    assert measurable(shape, 64) is None
    machine = local_machine(2, 0.5, None, shape, 2, 64, cfg=cfg, model_config=model_config(cfg, shape.vocab))
    assert machine.timing is None and machine.compute_source.startswith("FLOP path (--efficiency was given)")
    plan = make_plan(cfg, shape, machine, 1, None)
    assert plan.time.compute_path == "flops" and plan.time.timed is None


def test_fp8_divides_the_decoder_matmuls_by_the_published_factor_on_h100_and_is_unavailable_on_cpu(repo):
    from podtrain.plan.shape import model_shape

    FP8_SPEEDUP = 8532 / 6667  # torchtitan, Llama 3.1 8B on 8x H100, tokens/s/GPU with Float8 / without
    base_cfg, fp8_cfg = _cfg(repo, "train.global_batch_size=64"), _cfg(repo, "train.global_batch_size=64",
                                                                        fp8="tensorwise")
    shape = model_shape(base_cfg)
    for instance in ("p5.48xlarge", "p5e.48xlarge"):
        machine = instance_machine(instance, "auto", None, None)
        base, fp8 = (make_plan(c, shape, machine, 1, None).time for c in (base_cfg, fp8_cfg))
        assert fp8.matmul_s == pytest.approx(base.matmul_s / FP8_SPEEDUP, rel=1e-12)
        assert (fp8.attention_s, fp8.other_s) == (pytest.approx(base.attention_s), pytest.approx(base.other_s))
        assert fp8.compute_s < base.compute_s
        assert len(fp8.notes) == 1 and "torchtitan Llama 3.1 8B" in fp8.notes[0] and "published" in fp8.notes[0]
    # An A100 (capability 8.0) and this host's CPU: the plan says FP8 cannot run there, time unchanged.
    for machine in (instance_machine("p4d.24xlarge", "auto", None, None), local_machine(2, None, None)):
        base, fp8 = (make_plan(c, shape, machine, 1, None).time for c in (base_cfg, fp8_cfg))
        assert fp8.compute_s == pytest.approx(base.compute_s)
        assert "cannot run on" in fp8.notes[0] and "unavailable" in fp8.notes[0]


def test_fp8_tensorwise_halves_fsdp_weight_all_gather_bytes():
    shape = ModelShape(params=10_000_000, embedding_params=1_000_000, matmul_params=10_000_000,
                       flops_per_token=6e7, layers=4, hidden=512, attn_width=512, kv_width=512, heads=8,
                       intermediate=1024, vocab=1000, gated_mlp=True, rotary=True)
    work = Workload(micro_batch=1, accum=1, seq_len=128, bucket_bytes=25 << 20, dtype_bytes=2,
                    checkpointing=False, ckpt_every=0, async_save=True, eval_every=0, eval_batches=0)
    args = (shape, work, "fsdp", 8, 8, 1, 8, 1e12, 1e12, lambda nodes, nbytes: 100.0, True)
    bf16, fp8 = step_time(*args), step_time(*args, fp8_gather=True)
    # Gathered once per step (gathers=0.5 of a forward + backward pair): 2 x layers gathers of a layer
    # at 2 bytes, now 1 byte per weight; the reduce-scatter of fp32 gradients is unchanged.
    saved = 0.5 * 2 * shape.layers * (ring_gather_s(shape.layer_params * 2, 8, 100.0)
                                      - ring_gather_s(shape.layer_params * 1, 8, 100.0))
    assert bf16.comm_s - fp8.comm_s == pytest.approx(saved)


def test_document_masking_scales_attention_as_the_stated_model_says(repo):
    from podtrain.plan.shape import model_shape

    # The stated model: Poisson boundaries, share 2/x - 2(1 - e^-x)/x^2 of causal attention with
    # x = S/m; x 1.15 for flex_attention against a dense causal kernel (an estimate).
    FLEX_OVERHEAD = 1.15
    x = 2048 / 256
    share = 2 / x - 2 * (1 - math.exp(-x)) / x**2
    cfg = _cfg(repo, "data.seq_len=2048", "train.global_batch_size=64")
    masked = _cfg(repo, "data.seq_len=2048", "train.global_batch_size=64", masking=True)
    shape = model_shape(cfg)
    machine = instance_machine("p5.48xlarge", "auto", None, None)
    base = make_plan(cfg, shape, machine, 1, None).time
    got = make_plan(masked, shape, machine, 1, None, mean_document=256).time
    assert got.attention_s == pytest.approx(base.attention_s * share * FLEX_OVERHEAD)
    assert (got.matmul_s, got.other_s) == (pytest.approx(base.matmul_s), pytest.approx(base.other_s))
    assert "Poisson" in got.notes[0] and "FlexAttention" in got.notes[0]
    # Documents longer than any sample: nothing saved, the kernel's overhead remains.
    long = make_plan(masked, shape, machine, 1, None, mean_document=1e12).time
    assert long.attention_s == pytest.approx(base.attention_s * FLEX_OVERHEAD)
    # Documents shorter than a flex_attention block: one 128-token block row is computed at least.
    short = make_plan(masked, shape, machine, 1, None, mean_document=1).time
    assert short.attention_s == pytest.approx(base.attention_s * 128 / 2048 * FLEX_OVERHEAD)


def test_document_masking_on_cpu_times_attention_with_the_runs_explicit_mask(repo):
    plan = _measured_plan(repo, _cfg(repo, masking=True), mean_document=16)
    timing = plan.machine.timing
    assert timing.masked and plan.time.timed["masked_attention"] is True
    assert "timed here with the run's explicit mask (documents of 16 tokens)" in plan.time.notes[0]
    assert plan.time.attention_s == pytest.approx(timing.layers * timing.attention_s)
    # The text says which path it took.
    from podtrain.plan.render import render_plan

    assert "step time path: measured (a decoder layer, the LM head and loss, and the optimizer timed" in (
        render_plan(plan))
