"""The built-in corpus: this interpreter's standard-library ``.py`` sources, nothing downloaded.

A deterministic subset: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted
relative-path order, minus test suites, IDLE, installed packages and generated tables, taking
files in that order until the next one would exceed a byte budget. The same interpreter therefore
always yields the same corpus, which is what makes ``podtrain prepare builtin`` reproducible.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from podtrain.errors import UserError

DEFAULT_BUILTIN_BYTES = 8_000_000

# Directory names skipped anywhere in a path: test suites (repetitive, huge), IDLE and the turtle
# demos (GUI glue), third-party packages (not part of the interpreter), generated codec tables and
# pydoc's topic dump (data, not code).
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__",
    "turtledemo", "encodings", "pydoc_data", "lib2to3", "ensurepip", "config-3",
})


@dataclass(frozen=True)
class BuiltinFile:
    """One file of the built-in corpus: its name (relative path) and where it lies."""

    name: str
    path: Path
    size: int


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel_parts: tuple[str, ...]) -> bool:
    # config-3.11-x86_64-linux-gnu and friends: match the prefix, the suffix varies by platform.
    return any(part in EXCLUDED_DIRS or part.startswith("config-3") for part in rel_parts)


def builtin_files(max_bytes: int = DEFAULT_BUILTIN_BYTES, root: Path | None = None) -> list[BuiltinFile]:
    """The files of the built-in corpus, in order: the sorted ``.py`` files whose sizes fit ``max_bytes``.

    Files are taken in sorted relative-path order until the next one would exceed the budget.
    """
    if max_bytes <= 0:
        raise UserError(f"built-in corpus budget must be positive, got {max_bytes} bytes")
    base = Path(root) if root is not None else stdlib_dir()
    if not base.is_dir():
        raise UserError(f"standard-library directory {base} does not exist (built-in corpus)")
    candidates: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = Path(dirpath).relative_to(base)
        # Prune in place so os.walk never descends into excluded trees.
        dirnames[:] = [d for d in dirnames if not _excluded((d,))]
        if _excluded(rel_dir.parts):
            continue
        for fname in filenames:
            if fname.endswith(".py"):
                candidates.append(((rel_dir / fname).as_posix(), Path(dirpath) / fname))
    candidates.sort()
    chosen: list[BuiltinFile] = []
    total = 0
    for name, path in candidates:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(BuiltinFile(name=name, path=path, size=size))
        total += size
    if not chosen:
        raise UserError(f"built-in corpus is empty: no .py file under {base} fits {max_bytes} bytes")
    return chosen


def iter_builtin_documents(max_bytes: int = DEFAULT_BUILTIN_BYTES,
                           root: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(name, text)`` for each built-in document in deterministic order.

    Text is decoded as UTF-8 with undecodable bytes replaced (the standard library is UTF-8 by
    PEP 3120; replacement only guards against a patched installation).
    """
    for f in builtin_files(max_bytes, root):
        yield f.name, f.path.read_bytes().decode("utf-8", errors="replace")
