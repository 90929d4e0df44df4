"""``podtrain prepare --num-parts N --part I``: one corpus prepared by N independent tasks.

The design, in three steps (README "Preparing on many nodes"):

1. ``--train-tokenizer-only`` (only for ``--tokenizer bpe:VOCAB``): trains the BPE once, exactly as a
   one-shot prepare would (same text, same order), into ``DATA_DIR/tokenizer/`` with a record of the
   corpus it was trained for. Every part loads it; a part whose corpus or options differ is refused.
2. Part I of N (any order, any machine): the sources, in corpus order, are cut into N contiguous
   runs of about equal bytes (a file is never split across parts); part I prepares its run into
   ``DATA_DIR/parts/IIIII-of-NNNNN/`` with the ordinary pipeline (resume, idempotence, locking) and
   writes a part manifest last. Under ``srun`` or a Slurm job array, I comes from the task id.
3. ``podtrain prepare merge DATA_DIR``: checks that parts 0..N-1 are all there, finished and made
   from the same corpus and options, and writes ``DATA_DIR/manifest.json`` listing every part's
   shards in part order.

Why the result is the one-shot token stream: a document's split is a hash of its name, documents
are tokenized one by one, and a part's sources are a contiguous run of the corpus; so each split of
part 0, then part 1, ... concatenated is the one-shot split. Only where shard files are cut differs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from podtrain.data import tokenizer as tokmod
from podtrain.data.manifest import MANIFEST_NAME
from podtrain.data.prepare.replace import differences
from podtrain.data.prepare.shards import PARTS_DIR, STATE_DIR, read_run_state
from podtrain.data.prepare.sources import Source
from podtrain.distributed.env import task_slot
from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_text

PART_RE = re.compile(r"^(\d{5})-of-(\d{5})$")
TRAINED_RECORD = "trained-tokenizer.json"  # under DATA_DIR/.prepare: the corpus a BPE was trained for
MAX_PARTS = 99_999


def part_name(index: int, count: int) -> str:
    """The folder of part ``index`` of ``count`` under ``DATA_DIR/parts/``."""
    return f"{index:05d}-of-{count:05d}"


def part_dir(out: Path, index: int, count: int) -> Path:
    """Where part ``index`` of ``count`` is prepared."""
    return Path(out) / PARTS_DIR / part_name(index, count)


def part_key(corpus_key: str, index: int, count: int) -> str:
    """The run key of one part: the whole corpus's key plus the part's place in it."""
    blob = json.dumps({"corpus": corpus_key, "index": index, "count": count}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def split_sources(sources: list[Source], index: int, count: int) -> list[Source]:
    """Part ``index``'s sources: a file belongs to the part its first byte falls in, when the
    corpus's bytes are cut into ``count`` equal runs (contiguous, in corpus order; empty files go
    with their neighbours). A part may be empty when there are fewer files than parts."""
    total = max(1, sum(s.size for s in sources))
    mine, start = [], 0
    for src in sources:
        if min(count - 1, start * count // total) == index:
            mine.append(src)
        start += src.size
    return mine


def choose_part(num_parts: int, part: int | None, environ: Mapping[str, str] | None = None) -> int:
    """The part this process prepares: ``--part``, else the Slurm task id (array and/or srun).

    A task count that disagrees with ``--num-parts`` is refused: part ids would be skipped or doubled.
    """
    if not 1 <= num_parts <= MAX_PARTS:
        raise UserError(f"--num-parts {num_parts}: must be between 1 and {MAX_PARTS}")
    if part is None:
        slot = task_slot(environ)
        if slot is None:
            raise UserError(f"--num-parts {num_parts} needs --part I (0..{num_parts - 1}), "
                            "or run under srun or a Slurm job array, which give it")
        part, tasks = slot
        if tasks != num_parts:
            raise UserError(f"--num-parts {num_parts} but this Slurm job has {tasks} tasks "
                            "(array tasks x srun tasks): make them equal, or pass --part")
    if not 0 <= part < num_parts:
        raise UserError(f"--part {part}: must be between 0 and {num_parts - 1} (--num-parts {num_parts})")
    return part


def invalidate_merge(out: Path) -> None:
    """A part being (re)made makes the merged manifest stale: remove it (it is written last)."""
    (Path(out) / MANIFEST_NAME).unlink(missing_ok=True)


def write_trained_record(out: Path, corpus_key: str, identity: dict[str, Any],
                         recipe: dict[str, Any] | None = None) -> None:
    """Record which corpus and options the BPE in ``out/tokenizer/`` was trained for (and the
    recipe, ``replace.make_recipe``: what a refusal to train over it names)."""
    record: dict[str, Any] = {"corpus": corpus_key, "tokenizer": identity}
    if recipe is not None:
        record["recipe"] = recipe
    atomic_write_text(Path(out) / STATE_DIR / TRAINED_RECORD, json.dumps(record))


def _read_trained_record(out: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads((Path(out) / STATE_DIR / TRAINED_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def tokenizer_already_trained(out: Path, corpus_key: str, recipe: dict[str, Any], spec: str,
                              force: bool) -> dict[str, Any] | None:
    """Before ``--train-tokenizer-only`` writes ``out/tokenizer/``: the identity of the BPE already
    there for this corpus (``corpus_key``), trained by ``--train-tokenizer-only`` or by a one-shot
    prepare of the same command (the same text: it is adopted, recorded for the parts), else None.

    A tokenizer there trained from other inputs, vocabulary or options is refused in one line,
    naming only what differs (``vocabulary 4096 -> 2048``), unless ``force``: datasets prepared
    with ``--tokenizer DATA_DIR`` name it by its SHA-256, so training over it silently would leave
    them apart from every dataset prepared after.
    """
    out = Path(out)
    identity = trained_identity(out, corpus_key)
    if identity is not None:
        return identity
    state = read_run_state(out)  # a one-shot prepare of this very command trained the same BPE
    ident = state.get("tokenizer") if state and state.get("key") == corpus_key else None
    if isinstance(ident, dict) and ident.get("kind") != "byte" and tokmod.read_setup_file(out, ident):
        write_trained_record(out, corpus_key, ident, recipe)
        return ident
    main = out / tokmod.TOKENIZER_DIR / tokmod.TOKENIZER_FILE
    record = _read_trained_record(out)
    if force or not main.is_file() or (record is not None and record.get("corpus") == corpus_key):
        return None  # nothing there, told to replace it, or ours and damaged: train (again)
    old = (record or {}).get("tokenizer") or {}
    if record is not None and isinstance(record.get("recipe"), dict):
        why = ", ".join(differences(record, recipe, spec)) or "inputs changed since"
    elif record is not None:
        why = "other inputs or options"
    else:
        why = "no record of its inputs"
    name = f"{old['name']!r}, " if old.get("name") else ""
    raise UserError(f"--out {out} holds a tokenizer ({name}{main}) trained differently ({why}); "
                    f"training {spec} would replace it under the datasets prepared with --tokenizer {out}: "
                    "choose another --out, or pass --force to replace it")


def trained_identity(out: Path, corpus_key: str) -> dict[str, Any] | None:
    """The identity of the BPE trained for this corpus in ``out``, if it is there and intact."""
    rec = _read_trained_record(out)
    if rec is None or rec.get("corpus") != corpus_key:
        return None
    identity = rec.get("tokenizer")
    return identity if isinstance(identity, dict) and tokmod.read_setup_file(out, identity) else None


def load_trained(out: Path, corpus_key: str, spec: str) -> tokmod.LoadedHF:
    """The BPE that ``--train-tokenizer-only`` trained for this corpus, as the parts use it."""
    identity = trained_identity(out, corpus_key)
    if identity is None:
        raise UserError(f"{out}: no {spec} tokenizer trained for these inputs and options: run the same "
                        "`podtrain prepare` command with --train-tokenizer-only (without --num-parts/"
                        "--part) once, before the parts")
    import tokenizers  # only BPE parts get here

    blob = tokmod.read_setup_file(out, identity) or b""
    tok = tokmod.HFTokenizer(tokenizers.Tokenizer.from_str(blob.decode("utf-8")),
                             identity["eos_id"], kind=identity["kind"], name=identity["name"])
    return tokmod.LoadedHF(tok, {tokmod.TOKENIZER_FILE: blob})
