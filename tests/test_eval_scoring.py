"""The batched scorer behind `podtrain eval` against a plain one-request-at-a-time reference:
shared-context (KV cache) and batched paths, truncation, duplicates, rolling windows."""

import torch

from podtrain.eval.scoring import greedy_until, rolling_pairs, score_pairs
from podtrain.model import build_model, preset_config


def _reference(model, ctx, cont, max_length):
    full = [*ctx, *cont][-(max_length + 1):]
    n = min(len(cont), len(full) - 1)
    logits = model(input_ids=torch.tensor([full[:-1]])).logits[0, -n:].float()
    logp = torch.log_softmax(logits, -1)
    tgt = torch.tensor(full[-n:])
    return float(logp.gather(1, tgt[:, None]).sum()), bool((logits.argmax(-1) == tgt).all())


def test_score_pairs_equals_one_request_at_a_time():
    model = build_model(preset_config("tiny", 320), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(30)
    pairs = [(shared, ids(5)), (shared, ids(1)), (shared, ids(9)),  # one question's choices
             (ids(7), ids(3)), (ids(1), ids(4)), (ids(50), ids(6)),  # single requests
             (ids(40), ids(30))]  # longer than the window below: truncated from the left
    pairs.append(pairs[0])  # lm-eval's padding copies
    max_length = 48
    with torch.no_grad():
        want = [_reference(model, c, x, max_length) for c, x in pairs]
        got = score_pairs(model, pairs, batch_size=2, max_length=max_length)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want):
        assert abs(lp - ref_lp) < 1e-4 * max(1.0, abs(ref_lp)) and greedy == ref_greedy
    # the greedy flag is real: a continuation made of the model's own argmax tokens is greedy
    ctx = ids(10)
    with torch.no_grad():
        nxt = int(model(input_ids=torch.tensor([ctx])).logits[0, -1].argmax())
        assert score_pairs(model, [(ctx, [nxt]), (ctx, [(nxt + 1) % 256])], 4, 64)[0][1] is True


def test_rolling_windows_predict_every_token_once_and_greedy_stops():
    tokens = list(range(100, 125))
    pairs = rolling_pairs(tokens, prefix=256, max_length=10)
    assert [t for _, cont in pairs for t in cont] == tokens
    assert all(len(c) + len(x) <= 11 for c, x in pairs) and pairs[0][0] == [256]
    assert all(c[-1] == ([256] + tokens)[tokens.index(x[0])] for c, x in pairs)
    model = build_model(preset_config("tiny", 320), seed=0).eval()
    decode = lambda ids: bytes(i for i in ids if i < 256).decode("latin-1")  # noqa: E731
    text = greedy_until(model, [65, 66], decode, [], 6, eos_id=256, max_length=64)
    assert 0 < len(text) <= 6
    assert greedy_until(model, [65, 66], decode, [text[:1]], 6, eos_id=256, max_length=64) == ""


def test_max_tokens_bounds_every_forward_and_changes_no_score():
    model = build_model(preset_config("tiny", 320), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(20)
    pairs = [(shared, ids(4)), (shared, ids(6)), (shared, ids(2))] + [(ids(n), ids(3)) for n in (5, 30, 12, 40, 8)]
    sizes = []  # tokens of each forward: its input plus the KV cache it attends to

    def size(module, args, kwargs):
        rows, cache = kwargs["input_ids"], kwargs.get("cache", kwargs.get("past_key_values"))
        sizes.append(rows.numel() + (rows.shape[0] * cache.get_seq_length() if cache is not None else 0))

    hook = model.register_forward_pre_hook(size, with_kwargs=True)
    with torch.no_grad():
        whole = score_pairs(model, pairs, batch_size=8, max_length=64)
        big = max(sizes)
        sizes.clear()
        bounded = score_pairs(model, pairs, batch_size=8, max_length=64, max_tokens=50)
    hook.remove()
    assert big > 50 and max(sizes) <= 50  # one row alone (43 tokens) still fits
    for (lp, greedy), (ref_lp, ref_greedy) in zip(bounded, whole):
        assert abs(lp - ref_lp) < 1e-4 * max(1.0, abs(ref_lp)) and greedy == ref_greedy
