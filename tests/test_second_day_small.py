"""Issue 38 point 10, the small ones: each a real slip a new user met on the second day."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from podtrain.cli import main
from podtrain.config import MATH_KEYS
from podtrain.config_reference import field_docs
from podtrain.config_sections import CkptSection

REPO = Path(__file__).resolve().parents[1]


def test_the_help_and_the_package_name_every_strategy(capsys):
    assert main([]) in (0, 2)
    usage = capsys.readouterr()
    first = (usage.out or usage.err).splitlines()[0]
    assert "DDP, FSDP2 or HSDP" in first, first
    project = (REPO / "pyproject.toml").read_text()
    assert 'description = "Pre-train language models with PyTorch DDP, FSDP2 or HSDP:' in project


def test_allow_changes_documents_exactly_the_keys_it_accepts():
    """The docs named ``model.*`` (only two model keys are accepted) and ``data.tokenizer`` as if it
    were a config key: every accepted key is named, and data.tokenizer is said to be the data's."""
    doc = field_docs(CkptSection)["allow_changes"]
    assert "model.*" not in doc
    for key in MATH_KEYS:
        assert key in doc, key
    assert "data.tokenizer: not a config key" in " ".join(doc.split())


def test_a_price_of_ones_own_is_said_to_be_so_and_the_table_says_its_date(repo, capsys):
    demo = str(repo / "configs/demo.yaml")
    assert main(["plan", demo, "--instance-type", "p5.48xlarge", "--price-per-hour", "55", "train.global_batch_size=64"]) == 0
    mine = [line for line in capsys.readouterr().out.splitlines() if line.startswith("throughput")]
    assert len(mine) == 1 and "($55/node-h, from --price-per-hour)" in mine[0] and "2025" not in mine[0], mine
    assert main(["plan", demo, "--instance-type", "p5.48xlarge", "train.global_batch_size=64"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("throughput")]
    assert len(table) == 1 and "on demand as of 2025-05" in table[0] and "--price-per-hour USD for yours" in table[0]


def test_the_soaks_s3_round_imports_without_pytest():
    """bench/soak.py's S3 round imported a test module that imports pytest: a user running the
    bench from the bench extra met ModuleNotFoundError after the whole soak."""
    code = ("import sys; sys.modules['pytest'] = None; sys.path.insert(0, 'bench'); "
            "import soak_s3; print(soak_s3.records.__module__, soak_s3.s3_round.__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["outage_recovery", "s3_round"]
    # and the test modules it borrows still hand pytest its fixture when pytest is there
    tree = ast.parse((REPO / "tests/s3_fault_proxy.py").read_text())
    assert any(isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "s3_proxy" for n in ast.walk(tree))


def test_the_launchers_do_not_import_torch():
    """`podtrain launch local|slurm|k8s` and the k8s agent start in a fraction of a second: torch (~1.5 s
    of imports on a quiet machine, several seconds on a loaded one, before every launch) is for the
    ranks. The hang exit code the supervisor reads used to pull it in through the watchdog."""
    mods = ["podtrain.launch.local", "podtrain.launch.slurm", "podtrain.launch.k8s", "podtrain.launch.agent"]
    code = f"import sys; [__import__(m) for m in {mods!r}]; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
