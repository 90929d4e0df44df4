"""eval.tasks under FSDP scores with the sharded model itself (issue 26 point 5): no whole copy of
the weights on any rank, every rank as many forwards as the busiest (ranks with unequal shares,
shared contexts, early-stopping generations), the scores of the unsharded model."""

from types import SimpleNamespace

import pytest
import torch
# Imported once here, not in each forked rank (DTensor, FSDP and lm-eval take seconds to import).
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401

from multirank import run_ranks
from podtrain.config_sections import DistSection
from podtrain.data.tokenizer import ByteTokenizer
from podtrain.distributed.env import ClusterEnv
from podtrain.distributed.group import DistContext, process_group
from podtrain.model import build_model
from podtrain.train.precision import resolve_precision
from podtrain.train.strategy import build_for_strategy, build_strategy

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")
import lm_eval.evaluator  # noqa: E402,F401

# Each rank's requests: rank 0 has many (two questions sharing a context, one longer than the
# window, a long generation, a text of several windows), every other rank one short one of each kind.
LOGLIKELIHOOD = [
    [("def add(a, b):\n", "    return a + b\n"), ("def add(a, b):\n", "import os\n"), ("x = ", "1"),
     ("class P:\n", "    pass\n"), ("for i in range(3):\n", "    print(i)\n"), ("a" * 70, "b" * 9)],
    [("hello", " world")],
]
GENERATE = [[("hello", {"until": ["\n"], "max_gen_toks": 9}), ("def f():\n", {"until": ["\n\n"], "max_gen_toks": 9})],
            [("x", {"until": [], "max_gen_toks": 1})]]
ROLLING = [["some text, repeated. " * 9], ["short"]]


def small_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=320, max_position_embeddings=64,
                       tie_word_embeddings=True, use_cache=False)


def _score(lm, rank):
    ask = lambda items: [SimpleNamespace(args=a if isinstance(a, tuple) else (a,)) for a in items]  # noqa: E731
    mine = min(rank, 1)
    return (lm.loglikelihood(ask(LOGLIKELIHOOD[mine])), lm.generate_until(ask(GENERATE[mine])),
            lm.loglikelihood_rolling(ask(ROLLING[mine])))


def _sharded_rank(rank, world, strategy):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from podtrain.eval.adapter import PodtrainLM
    from podtrain.eval.lockstep import Lockstep

    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, reference = build_for_strategy(small_config(), "eager", 0, strategy, ctx)
        strategy = build_strategy(DistSection(strategy=strategy, shard_size=2), ctx,
                                  resolve_precision("fp32", ctx.device), 16, accumulate_unsharded=False)
        strategy.wrap(model, reference)
        del reference
        whole = sum(p.numel() for p in model.parameters())  # DTensors: the whole model's count
        gathered = []  # while a layer runs: the parameter elements held unsharded on this rank

        def count(module, args):
            gathered.append(sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor)))

        layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        hooks = [layer.register_forward_pre_hook(count) for layer in layers]
        lockstep = Lockstep(model, ctx, pad_token=ByteTokenizer.eos_id)
        beats = []  # the loop's watchdog: a rank joining the others' forwards is working too
        lm = PodtrainLM(model, ByteTokenizer(), ctx, batch_size=2, lockstep=lockstep,
                        on_progress=lambda: beats.append(1))
        scores = _score(lm, rank)
        lockstep.close()
        for hook in hooks:
            hook.remove()
        resharded = all(isinstance(p, DTensor) for p in model.parameters())
        strategy.release()
        return scores, lockstep.forwards, lockstep.padding, max(gathered), whole, resharded, len(beats)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, world", [("fsdp", 2), ("hsdp", 4)])  # hsdp: 2 replicas x 2 shards
def test_sharded_scoring_runs_in_lockstep_holds_no_whole_copy_and_scores_as_the_whole_model(strategy, world):
    from podtrain.eval.adapter import PodtrainLM

    ranks = run_ranks(_sharded_rank, world, strategy, timeout=120)
    plain = build_model(small_config(), "eager", seed=0, device="cpu").eval()  # rank 0's reference
    one = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    for rank, (scores, forwards, padding, gathered, whole, resharded, beats) in enumerate(ranks):
        want = _score(PodtrainLM(plain, ByteTokenizer(), one, batch_size=2), rank)
        (ll, gen, rolling), (want_ll, want_gen, want_rolling) = scores, want
        assert [g for _, g in ll] == [g for _, g in want_ll] and gen == want_gen
        assert [lp for lp, _ in ll] == pytest.approx([lp for lp, _ in want_ll], abs=1e-5)
        assert rolling == pytest.approx(want_rolling, abs=1e-4)
        # at most the root and the running layer gathered: never the whole model
        assert gathered < whole and resharded and beats >= padding
    (_, busiest, none, *_), *others = ranks
    assert none == 0 and all(0 < f < busiest and f + p == busiest for _, f, p, *_ in others)  # joined rank 0's


def _task_rank(rank, world, task_dir, strategy):
    from podtrain.eval.evaluator import TaskEvaluator
    from podtrain.model import unwrap

    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        model, reference = build_for_strategy(small_config(), "eager", 0, strategy, ctx)
        chosen = build_strategy(DistSection(strategy=strategy), ctx, resolve_precision("fp32", ctx.device), 16)
        model = chosen.wrap(model, reference)
        calls = []
        hook = unwrap(model).register_forward_pre_hook(lambda m, a: calls.append(1))
        evaluator = TaskEvaluator(["code-choice"], [task_dir], None, None, ByteTokenizer(), 2)
        results, mine = evaluator.run(model, ctx)
        hook.remove()
        chosen.release()
        return (results or {}).get("results"), len(calls), mine


@pytest.mark.slow
def test_eval_tasks_under_fsdp_score_the_sharded_model_as_ddp_does(tmp_path):
    import json

    from podtrain.eval.tasks import task_yaml

    docs = [{"context": "def add(a, b):\n" * (i % 3 + 1), "choices": ["    return a + b\n", "import os\n"],
             "label": i % 2} for i in range(5)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "code.yaml").write_text(task_yaml("code-choice", tmp_path / "code.jsonl"))
    fsdp = run_ranks(_task_rank, 2, tmp_path, "fsdp", timeout=120)
    ddp = run_ranks(_task_rank, 2, tmp_path, "ddp", timeout=120)
    assert fsdp[0][0] == ddp[0][0] and fsdp[0][0]["code-choice"]["acc,none"] is not None
    # the sharded model itself scored, as many forwards on both ranks (3 documents against 2)
    (_, calls0, mine0), (_, calls1, mine1) = fsdp
    assert calls0 == calls1 > 0  # (a whole copy's forwards would not reach the sharded model)
    assert calls0 == mine0["forwards"] + mine0["padding_forwards"] == mine1["forwards"] + mine1["padding_forwards"]
    assert mine0["forwards"] != mine1["forwards"]
