"""The suite cleans up after itself: under the project's pytest settings a passing test's tmp_path
is gone when the session ends and a failing test's is kept (issue 30 point 9: `make test` left
2.4 GB in /tmp/pytest-of-root)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
def test_passes(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"x" * 1_000_000)

def test_fails(tmp_path):
    (tmp_path / "kept.bin").write_bytes(b"y")
    assert False
'''


def test_a_passing_tests_data_is_deleted_and_a_failing_tests_kept(tmp_path):
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_sample.py").write_text(TESTS)
    root = tmp_path / "temproot"
    root.mkdir()
    env = dict(os.environ, PYTEST_DEBUG_TEMPROOT=str(root))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path / "suite"),
                           str(tmp_path / "suite" / "test_sample.py")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    left = sorted(p.name for p in root.rglob("*") if p.is_file())
    assert left == ["kept.bin"], left
