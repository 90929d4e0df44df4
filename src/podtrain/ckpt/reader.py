"""Reading checkpoints whole, without a process group: ``sample``, ``export``, ``eval``, tests.

(A resume reads only each rank's share instead: ``podtrain.ckpt.load``.)

``read_checkpoint`` puts the tensors of a checkpoint together from their pieces (whatever strategy
and world size wrote it), checking every block's CRC-32; ``load_latest`` and ``load_step`` find a
run's checkpoint (a directory holding a pickle file is refused with a ``UserError`` before any of
it is read) and read its MODEL tensors only: the optimizer's pieces (AdamW: twice the weights) are
never read for ``sample``, ``export`` or ``eval``. ``build_model_from_checkpoint`` gives the
transformers model it holds; ``run_data`` the data its tokenizer comes from (the one source of
the tokenizer for all three commands).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from podtrain.ckpt import layout
from podtrain.ckpt.load import check_fit, piece_index, read_small, read_small_json
from podtrain.ckpt.state import from_plain
from podtrain.storage.errors import Transient
from podtrain.ckpt.store import StorageError, open_store
from podtrain.ckpt.tensorio import DTYPES, CorruptCheckpoint, decode_small, verify_blocks
from podtrain.data.manifest import MANIFEST_NAME, Manifest, read_manifest
from podtrain.data.mixture import primary_path
from podtrain.errors import UserError


@dataclass
class CheckpointData:
    """A checkpoint read into memory."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    """Weights by unwrapped name, tied names included."""
    state: dict[str, Any]
    """Decoded state.json: scaler, train_state, optimizer values (and, podtrain-ckpt/2 only, every
    rank's rng; /3 keeps each rank's in its sidecar)."""
    model_config: dict[str, Any] | None
    """The transformers model config (config.json), when the model had one."""
    optimizer: dict[str, torch.Tensor] | None = None
    """The optimizer's tensors by flattened name (``state.<param>.exp_avg``); None when only the
    model was read (``load_latest``, ``load_step``)."""


def read_tensors(store, name: str, manifest: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every stored tensor whose name starts with ``prefix`` (dropped), whole, blocks verified."""
    index = piece_index(manifest, store, name)  # a whole checkpoint: every rank's sidecar
    out = {}
    for tname, info in manifest.get("tensors", {}).items():
        if not tname.startswith(prefix):
            continue
        dtype = DTYPES[info["dtype"]]
        whole = torch.empty(tuple(info["shape"]), dtype=dtype)
        flat = whole.reshape(-1).view(torch.uint8)
        esize = whole.element_size()
        covered = 0
        for piece in index.get(tname, []):
            dst = flat[piece.start * esize:(piece.start + piece.count) * esize]
            store.read_into(f"{name}/{piece.file}", piece.offset, dst.numpy())
            verify_blocks(memoryview(dst.numpy()), piece.crcs, 0, f"{store.url}/{name}/{piece.file} ({tname})")
            covered += piece.count
        if covered != whole.numel():
            raise CorruptCheckpoint(f"{store.url}/{name}: tensor {tname} has {covered} of "
                                    f"{whole.numel()} elements stored")
        out[tname[len(prefix):]] = whole
    return out


def read_checkpoint(store, name: str, manifest: dict, optimizer: bool = True) -> CheckpointData:
    """Read a checkpoint (``name`` in ``store``, files named by ``manifest``); no process group.
    ``optimizer=False``: the model's tensors only (the optimizer's pieces are not read at all)."""
    raw = read_small_json(store, name, manifest, layout.STATE_JSON)
    small = decode_small(read_small(store, name, manifest, layout.STATE_FILE))
    weights = read_tensors(store, name, manifest, "model/")
    for alias, target in raw.get("aliases", {}).items():
        weights[alias] = weights[target]
    state = {k: from_plain(v, small) for k, v in raw.items() if k != "aliases"}
    config = None
    if layout.CONFIG_JSON in manifest["files"]:
        config = read_small_json(store, name, manifest, layout.CONFIG_JSON)
    local = store.local_path(name)
    return CheckpointData(path=local if local is not None else Path(f"{store.url}/{name}"),
                          step=int(manifest["step"]), model_state=weights, state=state, model_config=config,
                          optimizer=read_tensors(store, name, manifest, "optim/") if optimizer else None)


def peek_train_state(store, name: str, manifest: dict) -> dict[str, Any]:
    """The loop's train state of a checkpoint (config, tokenizer, step...), from state.json alone."""
    raw = read_small_json(store, name, manifest, layout.STATE_JSON).get("train_state") or {}
    try:
        return from_plain(raw, {})
    except KeyError:  # a train state with tensors: not podtrain's loop's, nothing to compare
        return {}


def load_weights(net: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Copy ``weights`` into ``net``; a different architecture is a one-line user error."""
    check_fit(path, {k: v.shape for k, v in weights.items()}, net.state_dict())
    net.load_state_dict(weights, strict=True)


def load_latest(run_dir: str | os.PathLike) -> CheckpointData:
    """The newest valid checkpoint of a run, its model read into memory (no process group needed;
    the optimizer's pieces are not read)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    store = open_store(layout.run_ckpt_url(run_dir))
    choice = layout.find_latest(store)
    if choice.name is None:
        raise UserError(f"run directory {run_dir} has no complete checkpoint under "
                        f"{store.url} (train first, or check run.dir)")
    try:
        return read_checkpoint(store, choice.name, choice.manifest, optimizer=False)
    except CorruptCheckpoint as exc:
        raise UserError(f"checkpoint {exc} (corrupted: resume the run to fall back to an older one)") from None


def load_step(run_dir: str | os.PathLike, step: int) -> CheckpointData:
    """A run's checkpoint of ``step``, its model read into memory (not the optimizer); a UserError
    naming the steps there when it is absent or not valid."""
    store, name = open_store(layout.run_ckpt_url(run_dir)), layout.step_name(step)
    manifest, why = layout.check(store, name) if name in store.list_dirs("") else (None, "no such checkpoint")
    if manifest is not None:
        try:
            return read_checkpoint(store, name, manifest, optimizer=False)
        except Transient:  # an outage is not a bad checkpoint: never skip one for it
            raise
        except (CorruptCheckpoint, StorageError) as exc:
            why = str(exc)
    steps = [s for s, _ in layout.committed_steps(store)]
    raise UserError(f"{store.url}/{name}: {why} (checkpoints of {run_dir}: {', '.join(map(str, steps)) or 'none'})")


def run_config_of(run_dir: str | os.PathLike, ckpt: CheckpointData) -> dict[str, Any]:
    """The run's resolved config: the checkpoint's own copy, else ``RUN_DIR/config.yaml``."""
    config = ckpt.state.get("train_state", {}).get("config")
    if isinstance(config, dict):
        return config
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{path} is missing and checkpoint {ckpt.path} carries no config")
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def load_latest_weights(run_dir: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], int]:
    """``(resolved run config dict, weights by unwrapped name, step)`` of a run's newest checkpoint."""
    ckpt = load_latest(run_dir)
    return run_config_of(run_dir, ckpt), ckpt.model_state, ckpt.step


def build_model_from_checkpoint(ckpt: CheckpointData, run_config: dict[str, Any]) -> nn.Module:
    """The transformers model a checkpoint holds, weights loaded, in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    config = model_config_of(ckpt, run_config)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_weights(net, ckpt.model_state, ckpt.path)
    return net.eval()


def model_config_of(ckpt: CheckpointData, run_config: dict[str, Any]) -> Any:
    """The transformers config: the checkpoint's config.json, else rebuilt from the preset."""
    if ckpt.model_config is not None:
        from transformers import CONFIG_MAPPING

        raw = dict(ckpt.model_config)
        return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    from podtrain.model import preset_config

    embed = next((v for k, v in ckpt.model_state.items() if k.endswith("embed_tokens.weight")
                  or k.endswith("wte.weight")), None)
    vocab = int(embed.shape[0]) if embed is not None else None
    return preset_config(run_config.get("model", {}).get("preset", "tiny"), vocab)


def check_tokenizer(ckpt: CheckpointData, identity: dict[str, Any], where: str | os.PathLike) -> None:
    """A UserError when the tokenizer of the data at ``where`` (its manifest's ``identity``) is not
    the one the checkpoint was trained with: the SHA-256 the checkpoint recorded (checkpoints
    from before it was recorded: the vocabulary must at least fit the model)."""
    recorded = (ckpt.state.get("train_state") or {}).get("tokenizer_sha256")
    if recorded and identity.get("sha256") and recorded != identity["sha256"]:
        raise UserError(f"tokenizer mismatch: {ckpt.path} was trained with tokenizer sha256 "
                        f"{recorded[:12]}, but {where} holds {identity.get('name')!r} (sha256 "
                        f"{identity['sha256'][:12]}); pass the run's own data directory")
    vocab = (ckpt.model_config or {}).get("vocab_size")
    if vocab and int(identity.get("vocab_size", 0)) > int(vocab):
        raise UserError(f"tokenizer mismatch: {where} holds {identity.get('name')!r} with "
                        f"{identity['vocab_size']} tokens, but {ckpt.path} has a vocabulary of {vocab}")


def run_data(ckpt: CheckpointData, run_config: dict[str, Any], data: str | os.PathLike | None = None) -> Manifest:
    """The prepared data a run's tokenizer comes from (``sample``, ``export`` and ``eval`` alike),
    checked against the tokenizer ``ckpt`` was trained with (``check_tokenizer``).

    ``data`` (``--data``) when given, else the run's ``data.path``, or the first source of its
    ``data.mix`` (every source of a mix shares one tokenizer: the run checked it at start); a
    folder or ``s3://bucket/prefix``, read through ``podtrain.storage`` (never made a ``Path``,
    which would turn ``s3://`` into ``s3:/``). Relative paths are relative to the current
    directory, as at training time. Data that cannot be found is a one-line ``UserError`` naming
    where it was looked for and the fix.
    """
    if data:
        where, origin = str(data), "--data"
    else:
        section = run_config.get("data") or {}
        mix = section.get("mix") or []
        where = primary_path(mix, section.get("path") or "")
        origin = "the first source of the run's data.mix" if mix else "the run's data.path"
    fix = "pass --data DATA_DIR (the run's prepared data: a folder or s3://bucket/prefix)"
    if not where:
        raise UserError(f"tokenizer not found: the run's config names no data (data.path and data.mix "
                        f"are empty); {fix}")
    if not open_store(where).exists(MANIFEST_NAME):
        raise UserError(f"tokenizer not found: {where} ({origin}) has no {MANIFEST_NAME}; {fix}")
    manifest = read_manifest(where)
    check_tokenizer(ckpt, manifest.tokenizer, manifest.root)
    return manifest


@dataclass
class Verdict:
    """Outcome of ``verify``."""

    ok: bool
    reason: str = ""


def verify(path: str | os.PathLike) -> Verdict:
    """Check one checkpoint directory completely, offline: manifest, sizes, every block's CRC-32
    (reads the whole checkpoint: for tools and tests; a resume verifies only what each rank reads)."""
    path = Path(path)
    store = open_store(str(path.parent))
    manifest, reason = layout.check(store, path.name)
    if manifest is None:
        return Verdict(False, reason)
    try:
        read_checkpoint(store, path.name, manifest)
    except Transient:  # an outage is not a bad checkpoint: never skip one for it
        raise
    except (CorruptCheckpoint, OSError, EOFError, StorageError) as exc:
        return Verdict(False, str(exc))
    return Verdict(True)
