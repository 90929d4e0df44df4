"""Shared fixtures: keep every test process to one compute thread (2-core CI machines)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

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


# -- work that waits on the network, started when the session starts -----------------------------
# Resolving a HyperPod image (pip against the real index) spends ~30 s waiting on the network and
# little CPU: started in the background as soon as the test that checks it is collected, it overlaps
# with the suite instead of adding to it. The test reads the result (tests/test_launch_k8s.py).
HYPERPOD_TEST = "test_a_hyperpod_image_installs_podtrain_with_hyperpod_elastic_agent"
_background: dict[str, tuple] = {}


def hyperpod_resolution_command(report: Path) -> list[str]:
    """pip resolving podtrain beside hyperpod-elastic-agent>=1.1.3 into one image, as a dry run."""
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--retries", "0", "--timeout", "30", "--report", str(report), str(REPO),
            "hyperpod-elastic-agent>=1.1.3"]


def pytest_collection_modifyitems(session, config, items):
    """Start the HyperPod resolution now when its test is selected."""
    if any(item.name == HYPERPOD_TEST for item in items):
        import subprocess
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="podtrain-hyperpod-"))
        log = open(folder / "pip.log", "w+")
        proc = subprocess.Popen(hyperpod_resolution_command(folder / "report.json"),
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        _background["hyperpod"] = (proc, folder, log)


def pytest_sessionfinish(session, exitstatus):
    """Never leave the background resolution running, nor its folder behind."""
    import shutil

    for proc, folder, log in _background.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)  # pip's log and report: nothing to keep in /tmp


@pytest.fixture
def hyperpod_resolution(tmp_path):
    """(exit code, pip's output, its --report path) of the HyperPod resolution: the one started at
    collection, or run now when this test was selected some other way."""
    import subprocess

    if "hyperpod" not in _background:
        report = tmp_path / "report.json"
        proc = subprocess.run(hyperpod_resolution_command(report), capture_output=True, text=True,
                              timeout=300)
        return proc.returncode, proc.stdout + proc.stderr, report
    proc, folder, log = _background["hyperpod"]
    code = proc.wait(timeout=300)
    log.seek(0)
    return code, log.read(), folder / "report.json"


@pytest.fixture(scope="session")
def resume_golden(tmp_path_factory):
    """test_resume's uninterrupted 2-rank run (a real torchrun, ~30 s of CPU), made once per session:
    test_resume's golden resumes and test_soak's reference both compare with it."""
    from test_resume import final_weights, finish, launch, losses, make_data

    base = tmp_path_factory.mktemp("golden")
    data = make_data(base / "data")
    code, out = finish(launch(REPO, base / "run", data))
    assert code == 0, out[-3000:]
    return {"repo": REPO, "data": data, "run_dir": base / "run", "losses": losses(base / "run"),
            "weights": final_weights(base / "run")}
