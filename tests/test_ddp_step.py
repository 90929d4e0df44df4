"""The DDP step on 2 real gloo ranks equals one process on the concatenated batch."""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from multirank import run_ranks
from podtrain.config_sections import OptimSection
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import process_group
from podtrain.model import build_model
from podtrain.train.optim import build_optimizer
from podtrain.train.precision import resolve_precision
from podtrain.train.step import Stepper
from podtrain.train.strategy import DDPStrategy, Strategy

SEQ, GLOBAL, MICRO, STEPS = 16, 8, 2, 3


def small_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
                       max_position_embeddings=64, tie_word_embeddings=True, use_cache=False)


def batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (GLOBAL, SEQ + 1), generator=g) for _ in range(STEPS)]


def make(world, ddp_wrap):
    model = build_model(small_config(), "eager", seed=0)
    opt = build_optimizer(model, OptimSection(lr=1e-3, implementation="foreach"), torch.device("cpu"))
    ddp = DDP(model) if ddp_wrap else None
    stepper = Stepper(ddp or model, DDPStrategy.of(ddp) if ddp else Strategy(), opt, resolve_precision("fp32", torch.device("cpu")),
                      grad_clip=1.0, world_size=world, global_target_tokens=GLOBAL * SEQ,
                      device=torch.device("cpu"))
    return model, ddp, stepper


def ddp_rank(rank, world, data):
    with process_group(ClusterEnv.detect(), "gloo"):
        model, ddp, stepper = make(world, True)
        forwards = [0]
        model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        fired_at = []

        def hook(state, bucket):  # records which micro-batch's backward communicates
            fired_at.append(forwards[0])
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        per_rank = GLOBAL // world
        grads = None
        for i, rows in enumerate(data):
            share = rows[rank * per_rank:(rank + 1) * per_rank]
            forwards[0] = 0
            fired_at_step = len(fired_at)
            stepper.accumulate(list(share.split(MICRO)))
            assert set(fired_at[fired_at_step:]) == {per_rank // MICRO}, fired_at
            if i == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            stepper.apply()
        loss, _ = stepper.stats.read(lambda t: torch.distributed.all_reduce(t))
        del ddp, stepper
        return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, loss, len(fired_at)


@pytest.mark.slow
def test_two_ranks_with_accumulation_match_one_process_on_the_whole_batch():
    data = batches()
    results = run_ranks(ddp_rank, 2, data)
    torch.manual_seed(0)
    model, _, stepper = make(1, False)
    ref_grads = None
    for i, rows in enumerate(data):
        stepper.accumulate([rows])  # the concatenated global batch in one micro-batch
        if i == 0:
            ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        stepper.apply()
    ref_loss, _ = stepper.stats.read(lambda t: t)
    ref_weights = {n: p.detach() for n, p in model.named_parameters()}

    (g0, w0, loss0, fired0), (g1, w1, loss1, _) = results
    for name, ref in ref_grads.items():
        torch.testing.assert_close(g0[name], ref, rtol=1e-5, atol=1e-6, msg=f"grad {name}")
    for name, ref in ref_weights.items():
        assert (w0[name] - ref).abs().max() < 1e-5, (name, (w0[name] - ref).abs().max().item())
        assert torch.equal(w0[name], w1[name]), f"ranks differ in {name}"
    assert abs(loss0 - ref_loss) < 1e-5 and loss0 == loss1
    assert fired0 > 0  # gradients were communicated, and (asserted per step) only in the last backward


def test_clipping_off_reports_the_norm_and_leaves_gradients_alone():
    data = batches()
    results = []
    for clip in (0.0, 1e9):  # off, and a limit that never bites: same weights, same norm
        model = build_model(small_config(), "eager", seed=0)
        opt = build_optimizer(model, OptimSection(lr=1e-3, implementation="foreach"), torch.device("cpu"))
        stepper = Stepper(model, Strategy(), opt, resolve_precision("fp32", torch.device("cpu")), clip, 1,
                          GLOBAL * SEQ, torch.device("cpu"))
        for rows in data:
            stepper.step([rows])
        loss, norm = stepper.stats.read(lambda t: t)
        results.append((norm, [p.detach().clone() for p in model.parameters()]))
    (norm_off, w_off), (norm_big, w_big) = results
    assert norm_off > 0 and abs(norm_off - norm_big) < 1e-6 * norm_big
    assert all(torch.equal(a, b) for a, b in zip(w_off, w_big))
