"""LR schedule, AdamW groups, presets, FLOPs and the FSDP memory check."""

import math

import pytest
import torch

from podtrain.config_sections import OptimSection
from podtrain.errors import UserError
from podtrain.model import PRESETS, build_model, estimate_params, model_size, preset_config, unwrap
from podtrain.train.optim import build_optimizer, lr_at


def test_lr_warmup_then_cosine():
    # Convention: lr for step s (0-based) of T steps; the warmup reaches the peak exactly at its
    # last step (s = W - 1) and only there; the decay ends exactly at min_lr on the last step
    # (s = T - 1). Here W = 10, T = 110: the cosine runs over steps 9 .. 109 (100 intervals).
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) < 1.0  # the peak is used for one step, not two
    assert lr_at(59, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(108, **kw) > 0.1
    assert lr_at(109, **kw) == 0.1  # the last step trains at min_lr exactly
    assert lr_at(500, **kw) == pytest.approx(0.1)  # past the end stays at min_lr
    assert lr_at(0, 1.0, 0.1, 0, 5) == 1.0 and lr_at(4, 1.0, 0.1, 0, 5) == 0.1  # no warmup


def test_wsd_extended_run_follows_the_longer_plan_until_its_decay():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    short = [lr_at(s, total_steps=100, **kw) for s in range(100)]
    planned = [lr_at(s, total_steps=300, **kw) for s in range(300)]
    # The short run's decay starts after step 79 (its last 20 steps); stopped and extended to 300
    # steps before then, it follows the 300-step plan exactly.
    assert short[:80] == planned[:80]
    assert planned[9] == 1.0 and planned[239] == 1.0 and planned[240] < 1.0 and planned[299] == 0.1
    assert short[79] == 1.0 and short[99] == 0.1 and short[80] < 1.0
    decay = planned[239:]
    assert all(a > b for a, b in zip(decay, decay[1:]))  # linear, monotone to min_lr
    assert lr_at(50, 1.0, 0.1, 10, 100, "constant") == 1.0


def test_no_weight_decay_on_norms_biases_embeddings():
    model = build_model(preset_config("gpt2-124m", 128), seed=0)  # has biases, LayerNorms, tied wte
    opt = build_optimizer(model, OptimSection(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert not any("wte" in n or "wpe" in n or ".ln_" in n or "bias" in n for n in decayed)
    assert "transformer.h.0.attn.c_attn.weight" in decayed
    # Exactly the implementation chosen for this device: fused AdamW exists on the CPU since torch 2.4
    # (below the floor), so auto must pick it; foreach only when asked.
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    foreach = build_optimizer(model, OptimSection(implementation="foreach"), torch.device("cpu"))
    assert foreach.defaults["foreach"] is True and not foreach.defaults["fused"]


@pytest.mark.parametrize("preset, millions", [("tiny", 1.8), ("gpt2-124m", 124.4), ("qwen2.5-0.5b", 494.0),
                                              ("llama-1b", 1235.8), ("llama-8b", 8030.3)])
def test_preset_sizes(preset, millions):
    assert estimate_params(preset_config(preset, None if preset != "tiny" else 320)) / 1e6 == \
        pytest.approx(millions, abs=0.1)
    assert preset in PRESETS


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {}), ("tiny", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    ("llama-1b", dict(num_hidden_layers=2)), ("llama-8b", dict(num_hidden_layers=2)),
    ("qwen2.5-0.5b", dict(num_hidden_layers=2)), ("qwen2.5-0.5b", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    ("gpt2-124m", dict(n_layer=2)), ("gpt2-124m", dict(n_layer=2, n_inner=1000, tie_word_embeddings=False)),
])
def test_the_formula_counts_equal_the_built_models(preset, overrides):
    """What a launcher and `podtrain plan` count without building the model equals what building it
    on the meta device counts (parameters and input embedding), for each preset and the flags the
    formula reads; another architecture is not guessed."""
    from podtrain.model import formula_counts, meta_counts

    config = preset_config(preset, 320 if preset == "tiny" else None)
    for key, value in overrides.items():
        setattr(config, key, value)
    assert formula_counts(config) == meta_counts(config)
    config.model_type = "mistral"
    assert formula_counts(config) is None


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_presets_numbers_have_the_shape_of_its_transformers_config(preset):
    """``launch local`` checks a run against a preset's numbers (no transformers import); they must
    give the shape the ranks' transformers config gives, field for field, at the data's vocabulary
    and at the preset's own; a config.json path has no numbers (transformers reads it)."""
    from podtrain.model import preset_numbers
    from podtrain.plan.shape import config_shape

    for vocab in (320, None):
        assert config_shape(preset_numbers(preset, vocab), 512) == config_shape(preset_config(preset, vocab), 512)
    assert preset_numbers("configs/some/config.json") is None


def test_flops_per_token_counts_the_tied_head_and_attention():
    config = preset_config("tiny", 320)
    model = build_model(config, seed=0)
    size = model_size(model, config, seq_len=256)
    assert size.matmul_params == size.params  # tied: the head's matmul uses the embedding
    assert size.flops_per_token == 6 * size.params + 12 * 4 * 192 * 256


def test_same_seed_same_weights():
    a = build_model(preset_config("tiny", 320), seed=3)
    b = build_model(preset_config("tiny", 320), seed=3)
    c = build_model(preset_config("tiny", 320), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def _unwrap_rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(preset_config("tiny", 320), seed=3)
    ddp = DDP(model)
    compiled = torch.compile(ddp)  # wraps lazily: nothing is compiled until it is called
    return [unwrap(w) is model for w in (model, ddp, compiled, torch.compile(model))], \
        unwrap(ddp) is ddp


@pytest.mark.slow
def test_unwrap_sees_through_real_ddp_and_compile_wrappers():
    from multirank import run_ranks

    for seen_through, ddp_returned in run_ranks(_unwrap_rank, 2, timeout=60):
        assert seen_through == [True, True, True, True] and not ddp_returned


def test_eight_billion_parameters_do_not_fit_one_80gb_gpu():
    from podtrain.config import load_config
    from podtrain.plan.fit import Devices, check_memory
    from podtrain.plan.shape import config_shape

    gpu = Devices("one GPU", 1, 80 * 2**30, gpu=True)
    cfg = load_config(None, ["model.preset=llama-8b", "data.seq_len=256", "train.micro_batch_size=1",
                             "train.global_batch_size=1"])
    shape = config_shape(preset_config("llama-8b"), 256)
    with pytest.raises(UserError, match=r"needs 1[23]\d\.\d GiB .* add nodes \(fsdp\)"):
        check_memory(cfg, shape, gpu, 1)
    assert check_memory(cfg, shape, gpu, 1, policy="warn").strategy == "ddp"  # warned, not refused
    small = load_config(None, ["model.preset=llama-1b", "data.seq_len=256", "train.micro_batch_size=1",
                               "train.global_batch_size=1"])
    assert check_memory(small, config_shape(preset_config("llama-1b"), 256), gpu, 1).strategy == "ddp"


def test_config_json_path_and_bad_preset(tmp_path):
    preset_config("tiny", 320).to_json_file(tmp_path / "config.json")
    assert preset_config(str(tmp_path)).hidden_size == 192
    with pytest.raises(UserError, match="neither a preset"):
        preset_config("gpt5")
