"""``train.fp8``: FP8 training through torchao's Float8Linear, on real gloo ranks running the real
training loop (the CPU runs ``torch._scaled_mm``, slowly; a GPU is what makes it fast, measured
by ``bench/fp8_speed.py``).

One module fixture trains three runs in one pair of forked ranks (fork and imports paid once): fp32
under ddp (the reference), FP8 tensorwise under ddp and under fsdp (FSDP2's FP8 all-gather of
weights, scales precomputed after every optimizer step). The tests compare their losses, kill and
resume an FP8 run against the fsdp one, and export it.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

try:  # first: it mutes torchao's import lines, which transformers' import triggers
    import podtrain.train.fp8  # noqa: F401
except ImportError:  # a tree without it: each test then fails on its own
    pass
# Imported once here, not in each forked rank (DTensor, FSDP, transformers and torchao take seconds).
import torch.distributed.checkpoint.state_dict  # noqa: F401,E402
import torch.distributed.fsdp  # noqa: F401,E402
import transformers.models.llama.modeling_llama  # noqa: F401,E402
import torchao.float8  # noqa: F401,E402

from multirank import run_ranks  # noqa: E402
from podtrain.errors import UserError  # noqa: E402
from test_resume import losses  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS = 20
"""Optimizer steps of the compared runs. The issue asks for 200 demo steps; on this 2-core CPU an
FP8 step costs ~2x an fp32 one (``_scaled_mm``'s CPU kernel plus the casts): 20 steps of the
demo's own shape (16 x 256 tokens) took 95 s (fp32), 170 s (fp8 ddp) and 210 s (fp8 fsdp) on the
shared machine (losses at step 20: 2.9608, 2.9605, 2.9614), so three runs of 200 would take over
half an hour. 20 steps of 8 x 64 tokens on the real corpus (the built-in one) take the loss from
5.7 to ~2.8 nats, well past the warm-up (5 steps), far enough to show a drift: what this test
asserts is that FP8 follows fp32's curve. The three runs cost ~2 min here (with start-ups), 30 steps ~2.5-3 min."""
MEAN_TOLERANCE = 0.05
"""Largest |mean FP8 loss - mean fp32 loss| over the last 10 steps, in nats (~2% of the loss
there). Measured: 0.0037 (ddp) and 0.0045 (fsdp) at 20 steps (0.013 and 0.011 over steps 21-30 of
a 30-step run). Step by step the runs drift apart as any two runs whose arithmetic differs do at
the demo's LR (3e-3) on 8-sequence batches: single-step gaps over the last 10 steps reached 0.031
(ddp) and 0.032 (fsdp) (0.033 and 0.030 at 30 steps), bounded by STEP_TOLERANCE."""
STEP_TOLERANCE = 0.1
"""Largest single-step |FP8 loss - fp32 loss| over the last 10 steps (~3x the measured 0.033)."""
COMMON = [f"train.steps={STEPS}", "train.micro_batch_size=4", "train.global_batch_size=8",
          "data.seq_len=64", "optim.warmup_steps=5", "optim.schedule=constant", "eval.every=0",
          "log.every=1", "log.progress=off", "monitor.watchdog=false", "monitor.straggler_every=0",
          "data.verify=false", "run.seed=7"]
# optim.schedule=constant: after the warm-up the LR does not depend on train.steps, so a shorter
# run (the kill-and-resume test's) follows the same trajectory as the first steps of a longer one.
RUNS = {"fp32_ddp": ["train.fp8=off"],
        "fp8_ddp": ["train.fp8=tensorwise"],
        "fp8_fsdp": ["train.fp8=tensorwise", "dist.strategy=fsdp"]}


def _train_all(rank, world, repo, base, data, runs):
    """Every run in ``runs`` one after the other on this forked rank (the real loop)."""
    from podtrain.config import load_config
    from podtrain.distributed.env import ClusterEnv
    from podtrain.train import loop

    out = {}
    for name, overrides in runs.items():
        cfg = load_config(os.path.join(repo, "configs/demo.yaml"),
                          [f"run.dir={base}/{name}", f"data.path={data}", "ckpt.every=0", *COMMON, *overrides])
        result = loop.train(cfg, ClusterEnv.detect())
        out[name] = (result.step, result.exit_code)
    return out


@pytest.fixture(scope="module")
def trained(builtin_corpus, tmp_path_factory):
    """The three runs of ``RUNS`` on 2 ranks (~2-3 min of this machine's CPU)."""
    base = tmp_path_factory.mktemp("fp8")
    done = run_ranks(_train_all, 2, str(REPO), str(base), str(builtin_corpus), RUNS, timeout=900)[0]
    assert done == {name: (STEPS, 0) for name in RUNS}
    return {"base": base, "data": builtin_corpus, "losses": {name: losses(base / name) for name in RUNS}}


@pytest.mark.slow
def test_fp8_under_ddp_and_fsdp_ends_within_tolerance_of_the_fp32_loss(trained):
    got = trained["losses"]
    assert all(sorted(l) == list(range(1, STEPS + 1)) for l in got.values())
    ref = got["fp32_ddp"]
    assert ref[STEPS] < ref[5] - 0.5, ref  # the reference learned: the comparison means something
    last = range(STEPS - 9, STEPS + 1)
    for name in ("fp8_ddp", "fp8_fsdp"):
        mean_gap = abs(sum(got[name][s] - ref[s] for s in last)) / len(last)
        step_gap = max(abs(got[name][s] - ref[s]) for s in last)
        detail = (name, mean_gap, step_gap, {s: (got[name][s], ref[s]) for s in last})
        assert mean_gap <= MEAN_TOLERANCE and step_gap <= STEP_TOLERANCE, detail
        assert got[name] != ref, name  # FP8 really ran: not fp32's losses bit for bit
    # The start-up line says so, and the run's config records it.
    config = (trained["base"] / "fp8_fsdp" / "config.yaml").read_text()
    assert "fp8: tensorwise" in config


def _kill_or_resume(rank, world, repo, run_dir, data, kill_at):
    from podtrain.config import load_config
    from podtrain.distributed.env import ClusterEnv
    from podtrain.train import loop

    if kill_at is not None:
        from fault_plugin import podtrain_faults

        podtrain_faults.install(f"kill:rank=1,step={kill_at},delay=0.05")
    cfg = load_config(os.path.join(repo, "configs/demo.yaml"),
                      [f"run.dir={run_dir}", f"data.path={data}", *COMMON, *RUNS["fp8_fsdp"],
                       "train.steps=6", "ckpt.every=3"])
    result = loop.train(cfg, ClusterEnv.detect())
    return result.step, result.exit_code


@pytest.mark.slow
def test_a_killed_fp8_fsdp_run_resumes_to_the_same_losses_bit_for_bit(trained, tmp_path):
    """SIGKILL of rank 1 in step 5 (checkpoint at 3), resume: steps 4-6 repeat the uninterrupted
    run's losses exactly. The resumed first step all-gathers with scales computed from the
    restored weights (torchao's dynamic path), the uninterrupted one with the scales precomputed
    after step 3 from the same weights: the same numbers."""
    run_dir = tmp_path / "killed"
    with pytest.raises(AssertionError, match="rank"):
        run_ranks(_kill_or_resume, 2, str(REPO), str(run_dir), str(trained["data"]), 5, timeout=300)
    assert max(losses(run_dir)) >= 4 and (run_dir / "ckpt" / "step_000003").is_dir()
    assert run_ranks(_kill_or_resume, 2, str(REPO), str(run_dir), str(trained["data"]), None,
                     timeout=300)[0] == (6, 0)
    got, want = losses(run_dir), trained["losses"]["fp8_fsdp"]
    assert sorted(got) == list(range(1, 7))
    assert got == {s: want[s] for s in range(1, 7)}  # bitwise, the resumed steps 4-6 included


@pytest.mark.slow
def test_the_export_of_an_fp8_run_is_plain_hugging_face_weights_with_the_trained_logits(trained, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from podtrain.ckpt.reader import build_model_from_checkpoint, load_latest, run_config_of
    from podtrain.export import export_run
    from podtrain.train import fp8

    run_dir, out = trained["base"] / "fp8_fsdp", tmp_path / "hf"
    assert export_run(run_dir, out)["step"] == STEPS
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F32"}, dtypes  # fp32 master weights, no FP8 tensors or scales
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported.model.layers[0].mlp.down_proj) is torch.nn.Linear  # plain HF modules

    ckpt = load_latest(run_dir)
    trained_model = build_model_from_checkpoint(ckpt, run_config_of(run_dir, ckpt))  # plain fp32
    as_trained = build_model_from_checkpoint(ckpt, run_config_of(run_dir, ckpt))  # as it trained:
    assert fp8.convert(as_trained, "tensorwise") == 4 * 7  # its FP8 linear layers
    rows = torch.tensor([list(b"def main():\n    return 0\n" * 2)])
    with torch.no_grad():
        want, got, fp8_logits = (m.eval()(rows).logits for m in (trained_model, exported, as_trained))
    assert (got - want).abs().max().item() <= 1e-5  # measured: 0 (the same fp32 weights and math)
    # The model as it trained (FP8 matmuls) differs from its export by FP8's rounding only:
    # measured a relative error of 0.0008 (max 0.025 on logits up to 7.5); bound 0.02.
    rel = ((fp8_logits - want).norm() / want.norm()).item()
    assert 0 < rel <= 0.02, rel


def test_a_bad_train_fp8_value_is_one_line_naming_the_key_and_the_choices(capsys):
    from podtrain.cli import main
    from podtrain.config import load_config

    with pytest.raises(UserError, match=r"'train.fp8' must be one of off, tensorwise, rowwise, got 'fp4'"):
        load_config(str(REPO / "configs/demo.yaml"), ["train.fp8=fp4"])
    assert main(["train", str(REPO / "configs/demo.yaml"), "train.fp8=mxfp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["podtrain: error: config key 'train.fp8' must be one of off, tensorwise, rowwise, "
                   "got 'mxfp8'"], err


BLOCK_TORCHAO = textwrap.dedent("""
    import sys
    from importlib.machinery import PathFinder

    class WithoutTorchao:
        '''sys.meta_path's path finder, blind to torchao: ``import torchao`` fails and
        ``importlib.util.find_spec("torchao")`` (transformers' availability check) is None, as
        where the package is not installed.'''
        def find_spec(self, name, path=None, target=None):
            if name == "torchao" or name.startswith("torchao."):
                return None
            return PathFinder.find_spec(name, path, target)

        def find_distributions(self, *args, **kwargs):  # importlib.metadata: no torchao either
            return (d for d in PathFinder.find_distributions(*args, **kwargs) if d.name != "torchao")

        def __getattr__(self, name):  # invalidate_caches, ...
            return getattr(PathFinder, name)

    sys.meta_path[sys.meta_path.index(PathFinder)] = WithoutTorchao()
    from podtrain.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_train_fp8_without_torchao_is_refused_in_one_line(builtin_corpus, tmp_path):
    """A real process in which torchao cannot be found (``sys.meta_path``'s path finder replaced
    by one that does not see it: Python's own behaviour for a package that is not installed)
    trains with train.fp8=tensorwise."""
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCHAO, "train", str(REPO / "configs/demo.yaml"), f"run.dir={tmp_path / 'run'}",
         f"data.path={builtin_corpus}", "train.fp8=tensorwise", "train.steps=1", "log.progress=off",
         "monitor.watchdog=false", "data.verify=false"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("podtrain: error")]
    assert err == ["podtrain: error: train.fp8 needs torchao: pip install 'podtrain[fp8]'"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_a_gpu_without_fp8_units_is_refused_naming_it_mocked_gpu(monkeypatch):
    """No GPU here: the device's capability and name are stand-ins (an A100: 8.0)."""
    from podtrain.train import fp8

    monkeypatch.setattr(fp8, "accelerator_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError) as info:
        fp8.check_supported("rowwise", torch.device("cpu"))
    assert str(info.value) == ("train.fp8=rowwise needs a GPU with FP8 units (compute capability >= 8.9: L4, "
                               "L40S, H100, H200, B200), but NVIDIA A100-SXM4-80GB has 8.0: set train.fp8=off")
    monkeypatch.setattr(fp8, "accelerator_capability", lambda device: (9, 0))  # an H100/H200 passes
    fp8.check_supported("tensorwise", torch.device("cpu"))
    fp8.check_supported("off", torch.device("cpu"))


def test_only_the_decoder_linears_with_dims_multiple_of_16_are_converted_and_autocast_holds():
    """The embedding and the LM head stay as they are; a 15-wide projection stays nn.Linear; under
    the CPU's bf16 autocast a converted layer returns bf16 like the rest of the model, its matmul
    still FP8."""
    from podtrain.model import build_model, preset_config
    from podtrain.train import fp8

    model = build_model(preset_config("tiny", vocab_size=320), seed=0)
    layer = model.model.layers[0]
    layer.mlp.gate_proj = torch.nn.Linear(192, 15, bias=False)  # not a multiple of 16: kept
    assert fp8.convert(model, "rowwise") == 4 * 7 - 1
    linears = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears["lm_head"] == "Linear" and linears["model.layers.0.mlp.gate_proj"] == "Linear"
    assert linears["model.layers.0.self_attn.q_proj"] == "Float8Linear"
    assert sum(kind == "Float8Linear" for kind in linears.values()) == 27
    assert list(model.state_dict()) == list(build_model(preset_config("tiny", vocab_size=320)).state_dict())
    x = torch.randn(2, 8, 192)
    q = layer.self_attn.q_proj
    exact = torch.nn.functional.linear(x, q.weight)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            in_bf16, as_bf16 = q(x), torch.nn.functional.linear(x, q.weight)
        in_fp32 = q(x)
    assert in_bf16.dtype == torch.bfloat16 and in_fp32.dtype == torch.float32
    # Under autocast the matmul is still FP8's (its error ~5%, bf16's ~0.3%), only relabelled bf16.
    error = {name: ((out.float() - exact).norm() / exact.norm()).item()
             for name, out in (("fp8 in bf16", in_bf16), ("fp8", in_fp32), ("bf16", as_bf16))}
    assert error["bf16"] < 0.01 < error["fp8 in bf16"] < 0.1 and 0.01 < error["fp8"] < 0.1, error
