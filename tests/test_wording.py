"""Small words users read: the stop line, the tokenizer's name (pure functions, no training)."""

from __future__ import annotations

import signal

from podtrain.config import load_config
from podtrain.train.resume import check_resume, tokenizer_identity
from podtrain.train.signals import StopSignal


def test_the_stop_line_promises_a_requeue_only_to_a_scheduler():
    stop = StopSignal([])  # no handlers installed: the flag is set as the handler would
    stop.received, stop.received_at = signal.SIGINT, None
    line = stop.saved_line(7, 0.4, 30.0)
    assert stop.ending == "interrupted" and "exiting with 130; run the same command to resume" in line
    assert "requeue" not in line and "signal reached another rank" in line
    stop.received = signal.SIGTERM
    line = stop.saved_line(7, 0.4, 30.0)
    assert stop.ending == "stopped" and "exiting with 143, which a scheduler that retries on 128-255 requeues" in line


def test_the_tokenizer_is_named_once_and_old_checkpoints_still_resume():
    bpe = {"kind": "bpe", "name": "bpe:4096", "vocab_size": 4096, "sha256": "1f2e3d4c5b6a7980"}
    assert tokenizer_identity(bpe) == "bpe:4096:1f2e3d4c5b6a"
    assert tokenizer_identity({"kind": "byte", "name": "byte", "vocab_size": 257}) == "byte:257"
    assert tokenizer_identity({"kind": "hf", "name": "gpt2", "vocab_size": 50257}) == "hf:gpt2:50257"
    cfg = load_config(None, [])
    # A checkpoint written before: the same tokenizer, said twice; resuming is not refused.
    old = {"config": {"data": {"seq_len": cfg.data.seq_len}}, "tokenizer": "bpe:bpe:4096:4096:1f2e3d4c5b6a"}
    check_resume(old, cfg, tokenizer_identity(bpe), 3, "ckpt/step_3")
