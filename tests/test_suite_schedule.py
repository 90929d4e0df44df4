"""The suite's schedule under `make test` (pytest-xdist, --dist loadgroup): the order tests/conftest.py
gives is the order the workers start them in.

A small suite in a temporary folder, run by real pytest-xdist with the repository's own conftest.py:
a group of five cheap tests sharing a module fixture, a test marked cluster, one marked e2e, a group
of two e2e tests and three plain ones, on one worker (it runs them in the order xdist hands them
out). xdist's default reorder (groups by size, largest first) put 57 tests of eight groups, cheap ones
among them, before the real suite's Slurm group, which started ~150 s into a run.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a pytest and its xdist worker, each importing torch (conftest): ~5 s of CPU

FILES = {
    "test_a_group.py": '''
import pytest
from record import record

@pytest.fixture(scope="module")
def shared():
    return 1

@pytest.mark.parametrize("n", range(5))
def test_cheap(shared, n):
    record(f"group{n}")
''',
    "test_b_e2e.py": '''
import pytest
from record import record

pytestmark = pytest.mark.e2e

def test_e2e():
    record("e2e")
''',
    "test_b_e2e_group.py": '''
import pytest
from record import record

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module")
def trained():
    return 1

@pytest.mark.parametrize("n", range(2))
def test_e2e_sharing(trained, n):
    record(f"e2e_group{n}")
''',
    "test_c_cluster.py": '''
import pytest
from record import record

pytestmark = pytest.mark.cluster

def test_cluster():
    record("cluster")
''',
    "test_d_plain.py": '''
import pytest
from record import record

@pytest.mark.parametrize("n", range(3))
def test_plain(n):
    record(f"plain{n}")
''',
    "record.py": '''
import os

def record(name):
    with open(os.environ["SCHEDULE_LOG"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {name}\\n")
''',
    "pytest.ini": '''
[pytest]
markers =
    e2e: end-to-end
    cluster: cluster
    slow: slow
''',
}


def test_the_cluster_group_starts_first_then_e2e_then_the_rest_not_the_largest_group(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    for name, text in FILES.items():
        (suite / name).write_text(text.lstrip())
    log = tmp_path / "schedule.log"
    env = dict(os.environ, SCHEDULE_LOG=str(log))
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run on a worker
    env.pop("PODTRAIN_TEST_SESSION", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1",
                           "--dist", "loadgroup", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [line.split() for line in log.read_text().splitlines()]
    # One worker runs the work units in the order they are handed out: the cluster group, the e2e
    # tests (the group of two before the single one), then the rest (the group before the singles),
    # not the largest group (five cheap tests) first.
    assert [name for _, name in runs] == ["cluster", "e2e_group0", "e2e_group1", "e2e",
                                          *(f"group{n}" for n in range(5)), *(f"plain{n}" for n in range(3))], runs
