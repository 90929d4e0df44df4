"""Shared fixtures: keep every test process to one compute thread (2-core CI machines)."""

import gc
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

# A forked rank (tests/multirank.py, the fault-space harness) shares the test process's heap copy on
# write, until its first garbage collection walks every object and so copies every page it holds:
# ~0.16 s of CPU per fork of a process that imported torch and transformers (14,000 page faults),
# hundreds of forks per suite. Objects that exist at the fork are frozen out of the collector's
# reach (gc.freeze, as CPython's docs advise for pre-fork servers); the parent thaws them at once.
# A process that froze objects already (an in-process training's gc schedule) is left as it is:
# thawing would release its freeze too.
class _FreezeAroundFork:
    def __init__(self) -> None:
        self.froze: list[bool] = []  # per fork in flight, whether this hook froze (forks may overlap in threads)

    def before(self) -> None:
        self.froze.append(gc.get_freeze_count() == 0)
        if self.froze[-1]:
            gc.freeze()

    def after_in_parent(self) -> None:
        if self.froze.pop():
            gc.unfreeze()

    def after_in_child(self) -> None:
        self.froze.clear()


_around_fork = _FreezeAroundFork()
os.register_at_fork(before=_around_fork.before, after_in_parent=_around_fork.after_in_parent,
                    after_in_child=_around_fork.after_in_child)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo() -> Path:
    """The repository root."""
    return REPO


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (moto's ThreadedMotoServer) on 127.0.0.1 for the whole session; this process's
    environment points at it (AWS_ENDPOINT_URL, dummy credentials, AWS_REGION) until the session ends,
    so subprocesses inherit it. Skips when the test extra's moto[server] is not installed."""
    pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
    pytest.importorskip("s3torchconnector", reason="s3torchconnector (the s3 extra) is not installed")
    from s3_server import restore_env, start_with_env

    server, saved = start_with_env()
    yield server
    server.stop()
    restore_env(saved)


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """The name of a fresh, empty bucket on ``s3_server``."""
    return s3_server.new_bucket()


# -- running in parallel (pytest-xdist: `make test` and `make check` pass -n and --dist loadgroup) ---
# Under --dist loadgroup every test may land on any worker, except tests with the same xdist_group,
# which share one. Groups are given here, from what a test uses, so a new test file needs no mark:
# - "cluster": the real-Slurm and network-namespace tests (marked `cluster`): daemons, namespaces and
#   two-node trainings that would each want the whole machine, one after another on one worker;
# - "<module>::<fixture>": the tests sharing a module-scoped fixture they ask for (a trained run, a
#   prepared corpus), so it is built once. Autouse module fixtures (import warm-ups) group nothing.
# Heavy tests are handed out first, so that the last minutes are not one worker finishing a long test
# while the others idle: the "cluster" group first (the longest on one worker: Slurm's scheduling,
# two-node trainings, mostly waiting, so it overlaps the rest of the suite), then the tests marked e2e
# or slow, then the rest; within each, larger groups first, then file order. xdist hands out the
# groups in the order their first test has here only without its own reorder (by group size alone, on
# by default: 57 tests of eight groups, cheap ones among them, went before the Slurm group, which
# started ~150 s in), which pytest_configure turns off (tests/test_suite_schedule.py). Session
# fixtures that several workers use (the golden torchrun run) are built once under a lock in the
# session's folder and shared, not grouped.


def xdist_group_of(item) -> str | None:
    """The xdist group ``item`` must share a worker with, or None when it may run anywhere."""
    if item.get_closest_marker("cluster"):
        return "cluster"
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    autouse = set(info.initialnames) - set(info.argnames)
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name) or ()
        if name not in autouse and defs and defs[-1].scope == "module":
            return f"{item.module.__name__}::{name}"
    return None


def group_name(item) -> str | None:
    """The name in ``item``'s xdist_group mark (ours or the test file's own), or None."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return mark.args[0] if mark.args else mark.kwargs.get("name")


def start_order(items) -> dict[str, tuple[int, int]]:
    """Each item's sort key, by node id: (0 the cluster group, 1 the other heavy tests (e2e, slow),
    2 the rest; then larger groups first, as xdist's own reorder does, a group's tests running one
    after another on one worker)."""
    from collections import Counter

    sizes = Counter(group_name(item) for item in items)
    keys = {}
    for item in items:
        kind = 0 if item.get_closest_marker("cluster") else (
            1 if any(item.get_closest_marker(m) for m in ("e2e", "slow")) else 2)
        group = group_name(item)
        keys[item.nodeid] = (kind, -sizes[group] if group else -1)
    return keys


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """Group and order the tests for xdist (see above); start the HyperPod resolution when its
    test is selected."""
    if getattr(config.option, "dist", "no") != "no" or os.environ.get("PYTEST_XDIST_WORKER"):
        for item in items:
            group = xdist_group_of(item)
            if group and not item.get_closest_marker("xdist_group"):
                item.add_marker(pytest.mark.xdist_group(group))
        keys = start_order(items)
        items.sort(key=lambda item: keys[item.nodeid])  # stable: in file order within each
    if not config.option.collectonly and any(item.name == HYPERPOD_TEST for item in items):
        start_hyperpod_resolution()  # not for a collection alone (tests/compile_once.py): nothing runs


def pytest_collection_finish(session):
    """On an xdist worker under --dist loadgroup: every grouped test carries its group in its node
    id (what the scheduler reads), or the suite stops here: silently ungrouped, the Slurm tests would
    run at once and every worker would train the shared runs again (pytest 9.2 with pytest-xdist
    3.8: pytest-dev/pytest-xdist#1386)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        import xdist

        raise pytest.UsageError(
            f"--dist loadgroup did not group {lost[0]} (and {len(lost) - 1} more): pytest {pytest.__version__} "
            f"with pytest-xdist {xdist.__version__} (pytest-dev/pytest-xdist#1386); install the test extra "
            "(`make install`), which pins a pytest that works")


# -- work that waits on the network, started when the session starts -----------------------------
# Resolving a HyperPod image (pip against the real index) spends ~30 s waiting on the network and
# little CPU: started in the background as soon as the test that checks it is collected, it overlaps
# with the suite instead of adding to it. The test reads the result (tests/test_launch_k8s.py).
# Under xdist every worker collects the test but one runs it: the first worker to claim the run's
# folder (named after xdist's run id, the same in every worker) starts pip, whichever worker runs
# the test reads pip's exit code from that folder, and the controller removes it at the end.
HYPERPOD_TEST = "test_a_hyperpod_image_installs_podtrain_with_hyperpod_elastic_agent"


def hyperpod_resolution_command(report: Path) -> list[str]:
    """pip resolving podtrain beside hyperpod-elastic-agent>=1.1.3 into one image, as a dry run."""
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--retries", "0", "--timeout", "30", "--report", str(report), str(REPO),
            "hyperpod-elastic-agent>=1.1.3"]


SESSION_VAR = "PODTRAIN_TEST_SESSION"


def pytest_configure(config):
    """Name this session (the controller's name, inherited by xdist's workers, which it starts
    later): the folder the workers share for the background resolution carries it. Under
    --dist loadgroup, hand the groups out in ``start_order``'s order (xdist's own reorder off). A
    process that runs tests uses one torch thread."""
    if not os.environ.get(SESSION_VAR):
        import uuid

        os.environ[SESSION_VAR] = uuid.uuid4().hex[:12]
    if getattr(config.option, "loadscopereorder", False):  # the controller's scheduler reads it
        config.option.loadscopereorder = False  # keep start_order (see above), not xdist's by-size order
    if os.environ.get("PYTEST_XDIST_WORKER") or getattr(config.option, "dist", "no") == "no":
        # A process that runs tests: one compute thread (OMP_NUM_THREADS above may be a user's).
        # Not xdist's controller, which runs none: torch there cost every `make test` ~2 s of CPU.
        import torch

        torch.set_num_threads(1)


def _session_folder(kind: str) -> Path:
    """This test session's folder for ``kind`` (the same in every xdist worker; the controller
    removes it at the end)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"podtrain-{kind}-{os.environ[SESSION_VAR]}"


def _hyperpod_folder() -> Path:
    """This session's folder for the background resolution."""
    return _session_folder("hyperpod")


def start_hyperpod_resolution() -> None:
    """Start pip in the background (once per session, whichever worker gets here first): it writes
    pip.log, report.json, and its exit code to ``rc`` when it ends; ``pid`` names it."""
    import subprocess

    folder = _hyperpod_folder()
    try:
        folder.mkdir()
    except FileExistsError:  # another worker started it
        return
    shell = ('"$@" > "$0/pip.log" 2>&1; echo $? > "$0/rc.tmp" && mv "$0/rc.tmp" "$0/rc"')
    proc = subprocess.Popen(["sh", "-c", shell, str(folder), *hyperpod_resolution_command(folder / "report.json")],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    (folder / "pid").write_text(str(proc.pid))


def pytest_sessionfinish(session, exitstatus):
    """Never leave the background resolution running, nor its folder or the shared golden run
    behind (the controller, or a run without xdist: a worker leaves them to the others, which may
    still read them)."""
    import signal

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    shutil.rmtree(_session_folder("golden"), ignore_errors=True)  # the shared golden run
    folder = _hyperpod_folder()
    if not folder.exists():
        return
    if not (folder / "rc").exists() and (folder / "pid").exists():
        try:
            os.killpg(int((folder / "pid").read_text()), signal.SIGKILL)  # sh and its pip
        except (ProcessLookupError, ValueError):
            pass
    shutil.rmtree(folder, ignore_errors=True)  # pip's log and report: nothing to keep in /tmp


@pytest.fixture
def hyperpod_resolution(tmp_path):
    """(exit code, pip's output, its --report path) of the HyperPod resolution: the one started at
    collection, or run now when this test was selected some other way."""
    import subprocess
    import time

    folder = _hyperpod_folder()
    if not folder.exists():
        report = tmp_path / "report.json"
        proc = subprocess.run(hyperpod_resolution_command(report), capture_output=True, text=True,
                              timeout=300)
        return proc.returncode, proc.stdout + proc.stderr, report
    deadline = time.monotonic() + 300
    while not (folder / "rc").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    code = int((folder / "rc").read_text()) if (folder / "rc").exists() else -1
    return code, (folder / "pip.log").read_text(), folder / "report.json"


@pytest.fixture(scope="session")
def builtin_corpus(tmp_path_factory) -> Path:
    """`podtrain prepare builtin` (bytes), prepared once per session (once per xdist worker), in this
    process (no interpreter to start), for the tests that only read it: a run writes under run.dir,
    never into its data directory."""
    from podtrain.cli import main

    out = tmp_path_factory.mktemp("builtin") / "builtin"
    assert main(["prepare", "builtin", "--out", str(out), "--no-progress"]) == 0
    return out


GOLDEN_WAIT_S = 900.0
"""Longest a worker waits for another to finish training the shared golden run."""


@pytest.fixture(scope="session")
def resume_golden():
    """test_resume's uninterrupted 2-rank run (a real torchrun, ~30 s of CPU), made once per test
    session and shared by every xdist worker: the first worker to ask trains it under a lock in the
    session's folder, the others wait for it there (at most ``GOLDEN_WAIT_S``). So the tests that
    compare with it (test_resume's golden resumes, test_node_loss, test_soak's reference: ~10 min of
    worker time) spread over the workers instead of queueing on one. They only read it."""
    from podtrain.fsutil import flock_within
    from test_resume import final_weights, finish, launch, losses, make_data

    base = _session_folder("golden")
    base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not flock_within(fd, GOLDEN_WAIT_S, poll_s=0.2):
            raise AssertionError(f"another worker trained the golden run in {base} for over {GOLDEN_WAIT_S:g} s")
        if not (base / "done").exists():  # the first here (or the one after a failed try) trains it
            shutil.rmtree(base / "run", ignore_errors=True)
            make_data(base / "data")
            code, out = finish(launch(REPO, base / "run", base / "data"))
            assert code == 0, out[-3000:]
            (base / "done").write_text("trained\n")
    finally:
        os.close(fd)  # the lock goes with it
    return {"repo": REPO, "data": base / "data", "run_dir": base / "run", "losses": losses(base / "run"),
            "weights": final_weights(base / "run")}
