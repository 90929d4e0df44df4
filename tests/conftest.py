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
