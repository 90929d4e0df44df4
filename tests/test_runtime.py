"""Run-time contracts: collective timeouts (resumed runs, HSDP's subgroups), skipping a bad step
without torch's private state, and the GPU defaults (decided by pure functions; the GPU itself is
mocked where named)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
# Imported once here, not in each forked rank or timed test (DTensor and transformers take seconds).
import torch._dynamo  # noqa: F401  (train.compile)
import torch.distributed.fsdp  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh  # noqa: F401

from multirank import run_ranks
from podtrain.config_sections import GuardSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import process_group
from podtrain.errors import UserError
from podtrain.train import gpu_defaults
from podtrain.train.guard import StepJudge
from podtrain.train.precision import Precision
from podtrain.train.step import Stepper
from podtrain.train.strategy import Strategy, device_mesh

CPU = torch.device("cpu")


def group_timeout_s(group) -> float:
    """The timeout a gloo group's backend holds (test-only reading of torch's state)."""
    return group._get_backend(CPU).options._timeout.total_seconds()


# -- 6. timeouts -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_resumed_run_switches_to_the_steady_state_timeout(tmp_path, monkeypatch, repo):
    from podtrain.cli import main
    from podtrain.launch.local import free_port
    from podtrain.train import loop
    from synthetic_data import make_data_dir

    monkeypatch.chdir(repo)
    seen = []
    real_run = loop.Trainer.run

    def run_and_look(self):
        result = real_run(self)
        seen.append(group_timeout_s(dist.group.WORLD) if self.ctx.initialized else None)
        return result

    monkeypatch.setattr(loop.Trainer, "run", run_and_look)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    args = ["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={tmp_path / 'run'}", "data.seq_len=32",
            "train.micro_batch_size=2", "train.global_batch_size=2", "log.progress=off", "eval.every=0",
            "monitor.watchdog=false", "monitor.straggler_every=0", "dist.backend=gloo", "ckpt.async_save=false",
            "dist.init_timeout_s=100", "dist.timeout_s=40", "ckpt.every=1", "log.peak_flops=1e12"]
    assert main(args + ["train.steps=2"]) == 0  # one process without a launcher: no group
    # Resumed at step 2 as torchrun starts one rank: a real gloo group of one, the cluster's path.
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    assert main(args + ["train.steps=3"]) == 0  # its first step is step 3
    steady = 40 * 1.25 + 60  # collective_timeout(dist.timeout_s): the watchdog fires first
    assert seen == [None, steady]  # before the fix: the start-up timeout, 100 * 1.25 + 60


def _mesh_timeouts(rank, world):
    with process_group(ClusterEnv.detect(), "gloo", init_timeout_s=123.0, timeout_s=77.0) as ctx:
        mesh = device_mesh(ctx, (2, 2))
        groups = [mesh.get_group("replicate"), mesh.get_group("shard")]
        ranks = [dist.get_process_group_ranks(g) for g in groups]
        at_start = [group_timeout_s(g) for g in groups]
        ctx.startup_done()
        ctx.startup_done()  # once: a rollback's repeated steps change nothing
        steady = [group_timeout_s(g) for g in groups + [dist.group.WORLD]]
        return ranks, at_start, steady


@pytest.mark.slow
def test_hsdp_subgroups_take_podtrains_timeout_and_switch_to_the_steady_one():
    results = run_ranks(_mesh_timeouts, 4, timeout=60)
    assert [r[0] for r in results] == [[[0, 2], [0, 1]], [[1, 3], [0, 1]], [[0, 2], [2, 3]], [[1, 3], [2, 3]]]
    for _, at_start, steady in results:
        assert at_start == [123.0, 123.0]  # not the backend's default (NCCL: 10 min, gloo: 30 min)
        assert steady == [77.0, 77.0, 77.0]


# -- 10. skipping a bad step without private torch state ---------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm, self.out = torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16)

    def forward(self, input_ids):
        return type("O", (), {"logits": self.out(self.norm(self.emb(input_ids)))})


class _Verdicts(StepJudge):
    """The guard's device half with scripted verdicts (a spike: finite gradients, judged bad)."""

    def __init__(self, verdicts):
        super().__init__(GuardSection(spike_factor=0), CPU)
        self.verdicts = list(verdicts)

    def judge(self, norm):
        return torch.tensor(self.verdicts.pop(0))


def _changes(stepper, net, steps):
    changed = []
    for _ in range(steps):
        before = net.out.weight.detach().clone()
        stepper.step([torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))])
        changed.append(not torch.equal(before, net.out.weight))
    return changed


def test_a_fused_adamw_that_ignores_found_inf_is_refused_at_start_not_applied_silently():
    class RenamedAdamW(torch.optim.AdamW):
        """AdamW of a torch that no longer reads ``found_inf``."""

        def step(self, closure=None):
            self.__dict__.pop("found_inf", None)
            return super().step(closure)

    net = _Net()
    with pytest.raises(UserError, match="no longer skips a step given found_inf.*optim.implementation=foreach"):
        Stepper(net, Strategy(), RenamedAdamW(net.parameters(), lr=1e-2, fused=True), Precision("fp32", "cpu"),
                1.0, 1, 8, CPU, judge=_Verdicts([]))
    stepper = Stepper(net, Strategy(), torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True),
                      Precision("fp32", "cpu"), 1.0, 1, 8, CPU, judge=_Verdicts([False, True, False]))
    assert _changes(stepper, net, 3) == [True, False, True]


class FutureScaler(torch.amp.GradScaler):
    """GradScaler as a later torch might ship it: the same public API, its private per-optimizer
    state reachable by torch's own code only."""

    def __getattribute__(self, name):
        if name == "_per_optimizer_states" and not sys._getframe(1).f_globals["__name__"].startswith("torch"):
            raise AttributeError(f"{name} (private to torch)")
        return super().__getattribute__(name)


def test_fp16_spike_verdict_skips_the_step_through_the_scalers_public_api():
    net = _Net()
    stepper = Stepper(net, Strategy(), torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True),
                      Precision("fp16", "cpu"), 1.0, 1, 8, CPU, judge=_Verdicts([False, True, False]))
    stepper.scaler = FutureScaler("cpu", init_scale=2.0 ** 8)
    assert _changes(stepper, net, 3) == [True, False, True]
    assert stepper.scaler.get_scale() == 2.0 ** 7  # the skipped step backed the scale off, as an overflow


# -- 8. GPU defaults ---------------------------------------------------------------------------------
@pytest.mark.parametrize("precision, capability, env, expected", [
    ("fp32", (8, 0), {}, True), ("fp32", (9, 0), {}, True), ("fp32", (7, 0), {}, False),
    ("bf16", (9, 0), {}, False), ("fp32", None, {}, False),
    ("fp32", (9, 0), {"NVIDIA_TF32_OVERRIDE": "0"}, False)])
def test_tf32_only_for_fp32_on_ampere_or_newer_mocked_gpu(precision, capability, env, expected):
    assert gpu_defaults.tf32_wanted(precision, capability, env) is expected


def test_expandable_segments_unless_the_user_set_them_mocked_gpu():
    assert gpu_defaults.allocator_update({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert gpu_defaults.allocator_update({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == \
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}
    assert gpu_defaults.allocator_update({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"}) == \
        {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True"}
    for theirs in ("expandable_segments:False", "backend:cudaMallocAsync"):
        assert gpu_defaults.allocator_update({"PYTORCH_CUDA_ALLOC_CONF": theirs}) == {}
    env = {}
    gpu_defaults.set_allocator_default(env, gpu=False)  # the CPU: nothing to set
    assert env == {} and gpu_defaults.allocator_phrase(env) == "allocator defaults"
    gpu_defaults.set_allocator_default(env, gpu=True)  # mocked GPU
    assert gpu_defaults.allocator_phrase(env) == "allocator expandable_segments:True"


def test_start_up_line_records_tf32_and_the_allocator_mocked_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_defaults, "accelerator_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert gpu_defaults.apply_gpu_defaults("fp32", CPU, env) == "tf32 matmuls, allocator expandable_segments:True"
    assert calls == ["high"]
    assert gpu_defaults.apply_gpu_defaults("bf16", CPU, env) == "allocator expandable_segments:True"
    assert calls == ["high"]
    monkeypatch.setattr(gpu_defaults, "accelerator_capability", lambda device: None)  # the real CPU
    assert gpu_defaults.apply_gpu_defaults("fp32", CPU, env) == ""


@pytest.mark.slow
def test_compile_wraps_each_decoder_block_before_ddp_and_fully_shard(monkeypatch):
    import torch.distributed.fsdp as fsdp
    from transformers import LlamaConfig

    from podtrain.config_sections import DistSection
    from podtrain.launch.local import free_port
    from podtrain.train.strategy import build_for_strategy, build_strategy

    real_fully_shard, seen = fsdp.fully_shard, []

    def spy(module, **kwargs):  # was the module compiled when FSDP wrapped it?
        seen.append(module._compiled_call_impl is not None)
        return real_fully_shard(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=64, max_position_embeddings=64, use_cache=False)
    env = ClusterEnv.detect({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    monkeypatch.setenv("MASTER_ADDR", env.master_addr)
    monkeypatch.setenv("MASTER_PORT", str(env.master_port))
    with process_group(env, "gloo") as ctx:  # a real group of one: the wrappers need one
        for name in ("ddp", "fsdp"):
            model, reference = build_for_strategy(config, "eager", 0, name, ctx)
            names = [n for n, _ in model.named_parameters()]
            strategy = build_strategy(DistSection(strategy=name), ctx, Precision("fp32", "cpu"), 16,
                                      compile_blocks=True)
            wrapped = strategy.wrap(model, reference)
            layers = model.model.layers
            assert [layer._compiled_call_impl is not None for layer in layers] == [True, True]
            assert model._compiled_call_impl is None and wrapped is not None
            assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their names
            assert strategy.describe().endswith("torch.compile per decoder block (2)")
            strategy.release()
    assert seen == [True, True, False]  # fsdp: each block compiled before fully_shard; the root not
