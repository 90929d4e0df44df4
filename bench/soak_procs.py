"""Process trees, mounts and checkpoint files for ``bench/soak.py`` (Linux only).

The soak starts ``podtrain launch local`` jobs, whose torchrun agents run in their own sessions:
a process-group kill does not reach them. So the soak makes itself a child subreaper (orphaned
agents and workers re-parent to it) and finds everything it started as its own descendants in
/proc; cleanup SIGKILLs exactly those, by pid. It also runs in a private mount namespace
(``unshare``, re-executing itself): the tmpfs it mounts for the disk-full fault is visible only to
the soak and its children, and disappears with the namespace even if the soak itself is killed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

NAMESPACE_MARK = "PODTRAIN_SOAK_NAMESPACE"
"""Set in the re-executed soak, so it does not re-execute again."""

_PR_SET_CHILD_SUBREAPER = 36


# -- namespace and subreaper -----------------------------------------------------------------
def reexec_in_mount_namespace() -> None:
    """Re-execute this script in a private mount namespace (as root: ``unshare --mount``;
    otherwise also a user namespace mapping us to root, which may mount tmpfs). Returns only when
    already inside one; exits with a one-line error when neither works."""
    if os.environ.get(NAMESPACE_MARK):
        return
    unshare = shutil.which("unshare")
    if unshare is None:
        sys.exit("soak: error: `unshare` (util-linux) is needed for the disk-full fault's tmpfs mount")
    flags = ["--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]
    probe = subprocess.run([unshare, *flags, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        sys.exit(f"soak: error: cannot create a mount namespace ({probe.stderr.strip()}); the "
                 "disk-full fault needs root or unprivileged user namespaces")
    os.environ[NAMESPACE_MARK] = "1"
    os.execv(unshare, [unshare, *flags, sys.executable, *sys.argv])


def become_subreaper() -> None:
    """Orphaned descendants re-parent to this process, so ``descendants`` always finds them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


# -- /proc -----------------------------------------------------------------------------------
def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    return int(fields[1]), fields[0]


def descendants(root: int) -> list[int]:
    """Every living process below ``root`` (children first, then theirs)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _ppid_and_state(int(entry))
            if info is not None and info[1] != "Z":
                children.setdefault(info[0], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def environ_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with ({} when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the training workers under a ``launch local`` process: the processes
    whose parent is a torchrun agent (a worker's own children, e.g. loader processes, inherit
    RANK too and are not workers)."""
    tree = set(descendants(launcher))
    out = {}
    for pid in tree:
        info = _ppid_and_state(pid)
        rank = environ_of(pid).get("RANK")
        if info is not None and rank is not None and info[0] in tree and "RANK" not in environ_of(info[0]):
            out[int(rank)] = pid
    return out


def kill_tree(root: int) -> None:
    """SIGKILL ``root``'s descendants, then ``root`` (its parent reaps it)."""
    for pid in reversed(descendants(root)):
        _kill(pid)
    _kill(root)


def sweep(keep: set[int]) -> None:
    """SIGKILL every process below this one except the ``keep`` pids and their descendants (the
    orphans a dead launcher or agent left, re-parented here), and reap the orphans' zombies."""
    for child in _children(os.getpid()):
        if child not in keep:
            kill_tree(child)
    reap_orphans(keep)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _ppid_and_state(int(entry))
            if info is not None and info[0] == pid and info[1] != "Z":
                out.append(int(entry))
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap_orphans(exclude) -> None:
    """Collect zombies that re-parented to this subreaper (not the ``exclude`` pids, which their
    ``Popen`` objects reap)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in exclude:
            info = _ppid_and_state(int(entry))
            if info == (me, "Z"):
                try:
                    os.waitpid(int(entry), os.WNOHANG)
                except ChildProcessError:
                    pass


# -- tmpfs -----------------------------------------------------------------------------------
def mount_tmpfs(path: Path, size_bytes: int) -> None:
    """A tmpfs of ``size_bytes`` at ``path`` (created)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True,
                   capture_output=True, timeout=30)


def unmount(path: Path) -> None:
    """Unmount ``path`` if mounted (lazily when busy: nothing of the soak uses it any more)."""
    if os.path.ismount(path):
        done = subprocess.run(["umount", str(path)], capture_output=True, timeout=30)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fill(path: Path, leave_bytes: int) -> int:
    """Write ``path`` until its file system has about ``leave_bytes`` free; returns its size."""
    stat = os.statvfs(path.parent)
    free = stat.f_bavail * stat.f_frsize
    want = max(0, free - leave_bytes)
    chunk = b"\0" * (1 << 20)
    written = 0
    with open(path, "wb") as fh:
        while written < want:
            try:
                written += fh.write(chunk[: min(len(chunk), want - written)])
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                break
    return written


def data_file_sizes(step_dir: Path) -> list[int]:
    """Sizes of the non-JSON files under a checkpoint directory (its tensor data)."""
    return [p.stat().st_size for p in step_dir.rglob("*") if p.is_file() and p.suffix != ".json"]


def dir_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- checkpoints (only the public shape: ckpt/step_XXXXXXXX/, ckpt/latest) --------------------
def step_dirs(run_dir: Path) -> dict[int, Path]:
    """step -> directory of every ``ckpt/step_N`` present (complete or not)."""
    root = run_dir / "ckpt"
    out = {}
    if root.is_dir():
        for p in root.iterdir():
            name = p.name
            if p.is_dir() and name.startswith("step_") and name[5:].isdigit():
                out[int(name[5:])] = p
    return out


def latest_step(run_dir: Path) -> int:
    """The step ``ckpt/latest`` names (0 when there is none)."""
    try:
        name = (run_dir / "ckpt" / "latest").read_text().strip()
    except FileNotFoundError:
        return 0
    return int(Path(name).name.removeprefix("step_"))


def corrupt_largest_data_file(step_dir: Path, rng: random.Random, nbytes: int = 64) -> tuple[Path, int]:
    """Invert ``nbytes`` bytes in the second half of the largest non-JSON file under ``step_dir``
    (tensor data, past any header: the corruption only a checksum finds). Returns the file and
    the offset."""
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.suffix != ".json"]
    if not files:
        raise FileNotFoundError(f"{step_dir} holds no data file to corrupt")
    target = max(files, key=lambda p: p.stat().st_size)
    size = target.stat().st_size
    offset = rng.randrange(size // 2, max(size // 2 + 1, size - nbytes))
    with open(target, "r+b") as fh:
        fh.seek(offset)
        data = fh.read(nbytes)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in data))
        fh.flush()
        os.fsync(fh.fileno())
    return target, offset


def wait_for(predicate, timeout: float, poll: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False
