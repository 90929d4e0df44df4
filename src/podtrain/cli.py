"""The ``podtrain`` command: the only place that reads argv.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``. Only the chosen module is imported, so ``podtrain launch slurm`` does not pay
for importing transformers. A ``UserError`` anywhere becomes one line on stderr and exit code 2,
and so does a storage failure on a path (read-only or full disk, permissions: ``errors.storage_error``);
a storage outage that outlasted its retries (``storage.Transient``, also when another exception was
raised from it) is one line too, with exit code 203 (``errors.STORAGE_OUTAGE_EXIT_CODE``: retryable).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing

from podtrain import __version__
from podtrain.errors import UserError, storage_error

# command path -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("prepare",): ("podtrain.data.prepare.cli", "tokenize a corpus into shards + manifest.json"),
    ("prepare", "merge"): ("podtrain.data.prepare.merge", "join the parts of a --num-parts prepare"),
    ("train",): ("podtrain.train.loop", "train (each rank runs this under torchrun or srun)"),
    ("launch", "local"): ("podtrain.launch.local", "run torchrun on this machine"),
    ("launch", "slurm"): ("podtrain.launch.slurm", "write (and submit) a Slurm batch script"),
    ("launch", "k8s"): ("podtrain.launch.k8s", "write a Kubernetes PyTorchJob manifest"),
    ("sample",): ("podtrain.sample", "generate text from a run's latest weights"),
    ("export",): ("podtrain.export", "write a Hugging Face model folder from a run"),
    ("eval",): ("podtrain.eval.cli", "lm-eval tasks on a run's checkpoint or an exported folder"),
    ("plot",): ("podtrain.observe.plot", "draw runs' curves (loss, lr, throughput) to PNG or HTML"),
    ("bench", "collectives"): ("podtrain.diagnostics.collectives", "measure collectives' bandwidth"),
    ("doctor",): ("podtrain.diagnostics.doctor", "preflight checks of a cluster before a long run"),
    ("plan",): ("podtrain.plan.planner", "predict memory, step time, cost and scaling of a config"),
    ("report",): ("podtrain.plan.report", "a run's measured step split against its plan"),
}


def _usage() -> str:
    lines = [f"podtrain {__version__}: pre-train language models with PyTorch DDP, FSDP2 or HSDP", "", "commands:"]
    for path, (_, help_) in COMMANDS.items():
        lines.append(f"  podtrain {' '.join(path):<18} {help_}")
    lines.append("")
    lines.append("`podtrain COMMAND --help` shows a command's options.")
    return "\n".join(lines)


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: a usage mistake (a missing or unknown option, a value of the
    wrong type) is a ``UserError`` naming it, not argparse's usage block; and an optional
    positional (``overrides``, ``nargs="*"``) is never listed as required, which
    ``parse_intermixed_args`` does when the command has no arguments at all."""

    def error(self, message: str) -> typing.NoReturn:
        """Raise the one-line ``UserError`` (the CLI prints it and exits 2)."""
        required = "the following arguments are required: "
        if message.startswith(required):
            optional = {a.dest for a in self._actions if not a.option_strings and a.nargs in ("*", "?")}
            helps = {name: a.help for a in self._actions for name in (a.option_strings or [a.dest])}
            missing = [n for n in message[len(required):].split(", ") if n not in optional]
            message = "missing " + "; ".join(f"{n}: {helps[n]}" if helps.get(n) else n for n in missing)
        raise UserError(f"{self.prog}: {message}; `{self.prog} --help` shows every option")


def _find_command(argv: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    for length in (2, 1):
        path = tuple(argv[:length])
        if path in COMMANDS:
            return path, argv[length:]
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(f"podtrain {__version__}")
        return 0
    found = _find_command(argv)
    if found is None:
        groups = sorted({p[0] for p in COMMANDS if len(p) == 2})
        if argv[0] in groups:
            subs = [p for p in COMMANDS if p[0] == argv[0]]
            if argv[1:2] in (["-h"], ["--help"]):
                for path in subs:
                    print(f"  podtrain {' '.join(path):<18} {COMMANDS[path][1]}")
                return 0
            print(f"podtrain: error: `podtrain {argv[0]}` needs one of: "
                  f"{', '.join(p[1] for p in subs)}", file=sys.stderr)
        else:
            print(f"podtrain: error: unknown command {argv[0]!r} (see `podtrain --help`)", file=sys.stderr)
        return 2
    path, rest = found
    module_name, help_ = COMMANDS[path]
    try:
        module = importlib.import_module(module_name)
        parser = OneLineParser(prog=f"podtrain {' '.join(path)}", description=help_)
        module.add_arguments(parser)
        # intermixed: "CONFIG --nproc 2 k=v" puts overrides after options, as users type them
        args = parser.parse_intermixed_args(rest)
        from podtrain.storage import shared_s3_clients  # here: `podtrain --help` stays light

        with shared_s3_clients():  # the command's stores share one S3 client per endpoint, closed at its end
            return int(module.run(args) or 0)
    except UserError as exc:
        print(f"podtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("podtrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # an OSError, or an error raised from one (a background write's)
        error = storage_error(exc)
        if error is None:
            raise  # a bug, or a failure the user cannot fix by choosing a path: keep the traceback
        print(f"podtrain: error: {error}", file=sys.stderr)
        return error.exit_code


def console_main() -> None:
    """The ``podtrain`` command and ``python -m podtrain.cli`` (every rank): ``main``, then exit
    with its code."""
    code = main()
    # The process ends here. At shutdown Python's collector walks every object still alive, and
    # torch and transformers leave hundreds of thousands: ~0.5 s of CPU per process, per rank,
    # freeing memory the exit frees anyway. Frozen objects are skipped; atexit handlers still run.
    # (Not in ``main``: tests and tools call it in a process that goes on.)
    import gc

    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    console_main()
