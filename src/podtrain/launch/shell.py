"""Shell lines from argv lists: the one place where a value becomes part of a generated shell line.

The cluster launchers write shell that runs elsewhere: the worker pod's ``bash -c`` (``k8s.py``),
the batch script and the per-node script (``slurm.py``, ``templates/sbatch.sh``). A user's value
pasted into such a line raw is a bug with teeth: a space splits one argument into two, and
``$(...)`` or backquotes run a command on the cluster with the job's credentials. So those lines
are built from argv lists (``line``): every item is quoted (``shlex.quote``) unless it is a
``Var``, a variable of the script itself that expands where the line runs (``$POD_IP``,
``$SLURM_JOB_ID``). The launchers put no value into a shell line with an f-string.

A few characters no generated line can carry faithfully: control characters (NUL cannot be in
an argument at all; a newline ends a comment, an ``#SBATCH`` line or a log line early) and lone
surrogates (file-name bytes that are not UTF-8). ``check`` refuses them in one line naming the
key or flag; the generators call it on each user value before they write anything, and ``word``
asserts it (a value that skipped its check is a podtrain bug, never a quietly different script).
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from dataclasses import dataclass
from typing import Iterable, Union

from podtrain.errors import UserError


@dataclass(frozen=True)
class Var:
    """A variable of the generated script, expanded where the line runs: ``"$NAME"`` (the closing
    quote ends the name, so text may follow it in the same word)."""

    name: str

    def __post_init__(self) -> None:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name), f"not a shell variable name: {self.name!r}"


Part = Union[str, Var]
Word = Union[str, Var, tuple[Part, ...]]
"""One argument: literal text, a variable, or both joined (``concat``)."""


def concat(*parts: Word) -> Word:
    """One argument made of literal text and variables, e.g. ``concat("--local-addr=", Var("POD_IP"))``.
    Plain text when no part is a variable, so the same flags serve argv lists run without a shell."""
    flat: list[Part] = []
    for part in parts:
        flat.extend(part if isinstance(part, tuple) else (part,))
    if all(isinstance(p, str) for p in flat):
        return "".join(flat)  # type: ignore[arg-type]
    return tuple(flat)


def unrepresentable(value: str) -> str | None:
    """What in ``value`` no generated line can carry (``"a newline"``, ``"NUL"``...), or None."""
    for char in value:
        category = unicodedata.category(char)
        if category == "Cc":
            names = {"\0": "NUL", "\n": "a newline", "\r": "a carriage return", "\t": "a tab"}
            return names.get(char, f"the control character {char!r}")
        if category == "Cs":
            return f"the undecodable byte {char!r} (not UTF-8)"
    return None


def check(value: str, what: str) -> str:
    """``value``, unless it holds a character no generated line can carry (``unrepresentable``):
    then a one-line UserError naming ``what`` (the key or flag, e.g. ``run.dir``, ``--job-name``)."""
    bad = unrepresentable(value)
    if bad is not None:
        raise UserError(f"{what} {value!r} contains {bad}, which a generated job script cannot carry "
                        "safely; choose a name without it")
    return value


def word(item: Word) -> str:
    """``item`` as one shell word: literal text single-quoted where needed, variables as ``"$NAME"``."""
    parts = item if isinstance(item, tuple) else (item,)
    out = []
    for part in parts:
        if isinstance(part, Var):
            out.append(f'"${part.name}"')
        else:
            assert unrepresentable(part) is None, f"{part!r} reached a shell line without its check"
            out.append(shlex.quote(part))
    return "".join(out)


def line(*items: Word) -> str:
    """A shell command line from argv items (``word`` each): the program receives exactly these
    arguments, whatever characters the literal ones hold."""
    return " ".join(word(item) for item in items)


def plain(items: Iterable[Word]) -> list[str]:
    """argv for a program started without a shell (``subprocess``): literal text only."""
    items = list(items)
    assert all(isinstance(i, str) for i in items), f"a shell variable in an argv run without a shell: {items}"
    return items  # type: ignore[return-value]
