"""Resume honesty: what a resumed run trains must be what its config says.

Before a checkpoint is loaded, ``check_resume`` compares the config it was saved with (kept in
its train state) with the current one. A change that alters the math (``config.MATH_KEYS``:
model, data, sequence length, global batch, seed, tokenizer) is refused in one line naming each
key with both values, unless ``ckpt.allow_changes`` lists it; a longer or shorter ``train.steps``
under the cosine schedule is warned about (the curve jumps; WSD extends cleanly); other changes
are listed in one line. After loading, ``reapply_optimizer_hyperparameters`` puts the current
config's AdamW hyperparameters back into the optimizer, whose ``load_state_dict`` restored the
saved ones wholesale.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from podtrain.config import MATH_KEYS, RunConfig, to_dict
from podtrain.config_sections import OptimSection
from podtrain.data.manifest import said_once, tokenizer_identity  # noqa: F401 (the loop's and tests' name)
from podtrain.errors import UserError
from podtrain.train.optim import lr_at

log = logging.getLogger("podtrain")

# Keys whose difference says nothing about the training (where it runs, how it reports).
_NOT_COMPARED = ("run.dir", "ckpt.resume", "ckpt.allow_changes")


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}`` (the config's dotted keys)."""
    return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys present in both flattened configs whose values differ: ``{key: (saved, now)}``."""
    return {key: (saved[key], value) for key, value in current.items()
            if key in saved and saved[key] != value and key not in _NOT_COMPARED}


def check_resume(saved_state: dict[str, Any], cfg: RunConfig, tokenizer: str | None, step: int,
                 path: str) -> None:
    """Refuse (UserError) or report the differences between a checkpoint's config and ``cfg``.

    Every rank calls it with the same arguments (rank 0's choice), so all refuse alike.
    ``saved_state`` is the checkpoint's train state (``config``, ``tokenizer``); a checkpoint
    without a config (older podtrain) is accepted as it is.
    """
    saved = flatten(saved_state.get("config") or {})
    if not saved:
        return
    current = flatten(to_dict(cfg))
    if saved_state.get("tokenizer") is not None and tokenizer is not None:
        saved["data.tokenizer"], current["data.tokenizer"] = said_once(saved_state["tokenizer"]), tokenizer
    changes = config_changes(saved, current)
    math = {k: v for k, v in changes.items() if k in MATH_KEYS}
    refused = {k: v for k, v in math.items() if k not in cfg.ckpt.allow_changes}
    if refused:
        listed = "; ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in refused.items())
        raise UserError(
            f"checkpoint {path} (step {step}) was trained with a different setup: {listed}. Resuming "
            f"would train something else: restore the old values, use a new run.dir, or allow it "
            f"with ckpt.allow_changes=[{','.join(refused)}]")
    for key, (old, new) in math.items():
        log.warning("resuming with %s changed from %r to %r (allowed by ckpt.allow_changes)", key, old, new)
    if "train.steps" in changes and cfg.optim.schedule == "cosine":
        _warn_cosine_extension(cfg, step, *changes["train.steps"])
    others = {k: v for k, v in changes.items() if k not in MATH_KEYS}
    if others:
        log.info("resuming with changed settings: %s",
                 ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in others.items()))


def _warn_cosine_extension(cfg: RunConfig, step: int, old_steps: int, new_steps: int) -> None:
    """The cosine curve is planned over train.steps: changing it moves the LR of the next step."""
    o = cfg.optim
    before = lr_at(step - 1, o.lr, o.min_lr, o.warmup_steps, old_steps, "cosine")
    after = lr_at(step, o.lr, o.min_lr, o.warmup_steps, new_steps, "cosine")
    log.warning("train.steps changed from %d to %d under optim.schedule=cosine: the learning rate "
                "jumps from %.3g (step %d of the old plan) to %.3g; plan extendable runs with "
                "optim.schedule=wsd", old_steps, new_steps, before, step, after)


def reapply_optimizer_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimSection) -> list[str]:
    """Set weight decay, betas and eps from ``cfg`` on a freshly loaded optimizer; logs one line.

    ``load_state_dict`` restores the param groups as saved; the groups are those of
    ``optim.parameter_groups`` (decayed matrices first, then the undecayed rest, whose decay
    stays 0). Returns the changes as ``"key old -> new"`` strings.
    """
    wanted = {"betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    changed: dict[str, str] = {}
    for index, group in enumerate(optimizer.param_groups):
        targets = dict(wanted, weight_decay=cfg.weight_decay if index == 0 else group["weight_decay"])
        for key, value in targets.items():
            old = tuple(group[key]) if isinstance(group[key], (list, tuple)) else group[key]
            if old != value:
                label = {"betas": "optim.beta1/beta2"}.get(key, f"optim.{key}")
                changed[label] = f"{label} {old} -> {value}"
                group[key] = value
    if changed:
        log.info("optimizer hyperparameters from the current config (the checkpoint had others): %s",
                 ", ".join(changed.values()))
    return list(changed.values())
