"""User-facing errors: one line, exit code 2, no traceback (bugs keep theirs); a storage outage that
outlasted its retries: one line, exit code 203 (retried by schedulers)."""

from __future__ import annotations

import errno

USER_ERROR_EXIT_CODE = 2
STORAGE_OUTAGE_EXIT_CODE = 203
"""Exit code of a storage outage that outlasted the retries (``storage.Transient``): sysexits'
EX_TEMPFAIL (75) + 128. Kubeflow's ``restartPolicy: ExitCode`` retries 128-255 and fails the job on
1-127, so it is retried, unlike 2 (a user mistake) and 1 (a crash); it is above every signal's
128+N (1-64), so it is never read as a kill; the Slurm batch script requeues on it like after a
preemption."""
HANG_EXIT_CODE = 124
"""Exit code of a rank the hang watchdog ended (``distributed.watchdog``): the code coreutils
``timeout`` uses, so a job's exit status reads as "timed out", told apart from a crash (1) or a user
error (2). Here, beside the other exit codes, so the launchers read it without importing torch."""


class UserError(Exception):
    """A mistake the user can fix (bad config key, missing file, wrong flag).

    The CLI prints ``podtrain: error: <message>`` on one line and exits with code 2. The message
    must name the culprit: the file, the config key, the rank or the host.
    """

    exit_code = USER_ERROR_EXIT_CODE


STORAGE_ERRNOS = {
    errno.EROFS: "the file system is read-only; choose a writable location",
    errno.ENOSPC: "no space left on the device; free some or choose another location",
    errno.EDQUOT: "disk quota exceeded; free some space or choose another location",
    errno.EACCES: "permission denied; check its permissions or choose another location",
    errno.EPERM: "operation not permitted; check its permissions or choose another location",
    errno.ENOTDIR: "a file is in the way where a directory is needed",
    errno.EEXIST: "it exists and is not a directory",
}
"""The storage conditions that are the user's to fix, never a defect of podtrain: the disk, its
mount, its permissions, or a file where a folder must be. A missing file (ENOENT) is left out on
purpose: where a user names an input that does not exist the command says so itself, so an
ENOENT that gets this far is more likely a bug, and keeps its traceback."""


FULL_OR_READ_ONLY = (errno.EROFS, errno.ENOSPC, errno.EDQUOT)
"""Conditions of the disk itself: one line even when the failed write named no file (writes
that know their path name it with ``fsutil.naming``)."""


def storage_error(exc: BaseException) -> UserError | None:
    """The one-line ``UserError`` for a storage failure on a path (read-only disk, full disk,
    quota, permissions, a file where a folder must be), or None for anything else.

    Looks at ``exc`` and the exceptions it was raised ``from`` (a background checkpoint write
    re-raised at ``wait()``); only an ``OSError`` with one of ``STORAGE_ERRNOS`` that names its
    path (or, for ``FULL_OR_READ_ONLY``, names none) qualifies, so bugs keep their traceback. A
    storage outage (exit code ``STORAGE_OUTAGE_EXIT_CODE``) anywhere in that chain is returned as
    it is, so that whatever wrapped it, the process still exits with the retryable code.
    """
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, UserError) and exc.exit_code == STORAGE_OUTAGE_EXIT_CODE:
            return exc
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            verb = "write" if exc.errno in FULL_OR_READ_ONLY else "use"
            if exc.filename:
                return UserError(f"cannot {verb} {exc.filename}: {STORAGE_ERRNOS[exc.errno]}")
            if exc.errno in FULL_OR_READ_ONLY:  # never a bug, even where the OS named no file
                return UserError(f"a write failed: {STORAGE_ERRNOS[exc.errno]}")
        exc, seen = exc.__cause__, seen + 1
    return None
