"""Experiment trackers fed from metrics.jsonl's records: TensorBoard, Weights & Biases, MLflow.

``MetricsWriter`` writes each record to metrics.jsonl and then hands it to every tracker here, so
the trackers show exactly the numbers of the file (rank 0 only). ``log.trackers`` names them;
``auto`` (the default) means TensorBoard when its package is installed. Each tracker's package is
an optional extra; naming one that is not installed is a one-line error at start.

Where their data goes: TensorBoard event files under RUN_DIR/tb/; W&B under RUN_DIR/wandb/
(offline unless WANDB_MODE says otherwise: ``wandb sync`` uploads it later); MLflow in a local
SQLite store RUN_DIR/mlruns/mlflow.db (or MLFLOW_TRACKING_URI when set). A resumed run continues the same W&B and
MLflow run (matched by podtrain's run_id).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from podtrain.errors import UserError
from podtrain.fsutil import naming

log = logging.getLogger("podtrain")

# tracker name -> (module that must be importable, pip extra that installs it)
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
TRACKER_NAMES = ("auto", "none", *TRACKER_PACKAGES)

# Record fields that are not curves (identity, bookkeeping) and never go to a tracker.
_NOT_SCALARS = {"kind", "step", "run_id", "time", "world_size", "straggler_rank"}


class Tracker(Protocol):
    """One tracker's side of the fan-out."""

    def log(self, record: dict[str, Any]) -> None:
        """Record one metrics.jsonl record's scalars at its step."""

    def close(self) -> None:
        """Flush and finish."""


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_trackers(names: list[str]) -> list[str]:
    """The trackers ``log.trackers`` asks for: ``auto`` becomes tensorboard when installed,
    ``none`` nothing; a named tracker whose package is missing is a UserError naming the extra."""
    chosen: list[str] = []
    for name in names:
        if name == "none":
            continue
        if name == "auto":
            if _installed("tensorboard") and "tensorboard" not in chosen:
                chosen.append("tensorboard")
            continue
        if name not in TRACKER_PACKAGES:
            raise UserError(f"config key 'log.trackers': unknown tracker {name!r} "
                            f"(choose from {', '.join(TRACKER_NAMES)})")
        module, extra = TRACKER_PACKAGES[name]
        if not _installed(module):
            raise UserError(f"config key 'log.trackers' names {name!r} but the {module} package is "
                            f"not installed (pip install 'podtrain[{extra}]')")
        if name not in chosen:
            chosen.append(name)
    return chosen


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's curves as ``kind/field`` -> number (``train/loss``, ``eval/val_loss``); a
    per-source field (``tokens_by_source``) gives one curve per source
    (``train/tokens_by_source/web``)."""
    kind = record.get("kind", "train")
    if kind not in ("train", "eval"):
        return {}  # segment markers and the like are bookkeeping, not curves
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_SCALARS:
            continue
        if key.endswith("_by_source") and isinstance(value, dict):
            out.update({f"{kind}/{key}/{name}": float(v) for name, v in value.items() if _number(v)})
        elif _number(value):
            out[f"{kind}/{key}"] = float(value)
    return out


class TensorBoardTracker:
    """Event files under RUN_DIR/tb/ through torch's SummaryWriter, flushed every record.

    A resumed attempt starting after ``start_step`` sets TensorBoard's ``purge_step``: its reader
    then hides the killed attempt's events past that step, as ``observe/records.py`` does.
    """

    def __init__(self, run_dir: Path, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self._dir = run_dir / "tb"
        self._writer = SummaryWriter(log_dir=str(self._dir),
                                     purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict[str, Any]) -> None:
        """Add the record's scalars at its step; flushed so a killed run keeps them."""
        # The event writer's thread re-raises a full disk without a file name: name the folder.
        with naming(self._dir):
            for tag, value in scalars(record).items():
                self._writer.add_scalar(tag, value, global_step=record["step"])
            self._writer.flush()

    def close(self) -> None:
        """Close the event file."""
        with naming(self._dir):
            self._writer.close()


class WandbTracker:
    """A W&B run in RUN_DIR/wandb/, offline unless WANDB_MODE is set; id = podtrain's run_id."""

    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any]):
        import wandb

        # console="off": W&B must not wrap stdout, which torchrun already tees; silent: our line.
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "podtrain"), dir=str(run_dir),
                               id=run_id, name=run_dir.name, resume="allow", config=config,
                               mode=os.environ.get("WANDB_MODE", "offline"),
                               settings=wandb.Settings(console="off", silent=True))
        where = self._run.dir.rsplit("/files", 1)[0]
        log.info("W&B run %s (%s) in %s%s", run_id, self._run.settings.mode, where,
                 f": `wandb sync {where}` uploads it" if self._run.settings.mode == "offline" else "")

    def log(self, record: dict[str, Any]) -> None:
        """Log the record's scalars at its step."""
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        """Finish the run and wait until its files are written: ``finish`` alone may return
        before W&B's service process has flushed the run file."""
        import wandb

        self._run.finish()
        wandb.teardown()


class MlflowTracker:
    """An MLflow run in RUN_DIR/mlruns/mlflow.db (SQLite) unless MLFLOW_TRACKING_URI is set; a resumed
    podtrain run reopens the MLflow run tagged with its run_id."""

    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        store = (run_dir / "mlruns").resolve()
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            store.mkdir(parents=True, exist_ok=True)  # MLflow 3 keeps local runs in SQLite only
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{store / 'mlflow.db'}"
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name("podtrain")
        experiment_id = (experiment.experiment_id if experiment is not None else
                         self._client.create_experiment("podtrain", (store / "artifacts").as_uri()))
        found = self._client.search_runs([experiment_id], f"tags.podtrain_run_id = '{run_id}'")
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self._client.create_run(experiment_id, run_name=run_dir.name,
                                          tags={"podtrain_run_id": run_id})
            self.run_id = run.info.run_id
            for key, value in _flat(config).items():
                self._client.log_param(self.run_id, key, value)

    def log(self, record: dict[str, Any]) -> None:
        """Log the record's scalars at its step in one batch."""
        from mlflow.entities import Metric

        millis = int(1000 * record.get("time", 0))
        metrics = [Metric(tag, value, millis, record["step"]) for tag, value in scalars(record).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """Mark the run finished."""
        self._client.set_terminated(self.run_id)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def open_trackers(names: list[str], run_dir: Path, run_id: str, config: dict[str, Any],
                  start_step: int = 0) -> list[Tracker]:
    """Start the trackers ``log.trackers`` names for an attempt continuing after ``start_step``
    (rank 0 calls this; see ``resolve_trackers``)."""
    trackers: list[Tracker] = []
    for name in resolve_trackers(names):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir, start_step))
        elif name == "wandb":
            trackers.append(WandbTracker(run_dir, run_id, config))
        elif name == "mlflow":
            trackers.append(MlflowTracker(run_dir, run_id, config))
    return trackers
