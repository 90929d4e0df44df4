"""`make demo` installs podtrain alone, without the test extra's ~550 MB (moto, s3torchconnector,
lm-eval, ...), and what the demo runs (train with its evaluation and checkpoints, then sample)
needs nothing more."""

import subprocess
import sys

from podtrain.cli import main
from synthetic_data import make_data_dir

# The import names of every optional dependency (pyproject.toml's extras).
EXTRAS = ("tensorboard", "lm_eval", "moto", "boto3", "s3torchconnector", "matplotlib", "wandb", "mlflow",
          "pyarrow", "zstandard", "kubernetes_validate", "datatrove", "accelerate")


def test_make_demo_installs_podtrain_alone_and_the_demo_needs_no_extra(repo, tmp_path, monkeypatch, capsys):
    steps = subprocess.run(["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=repo, capture_output=True,
                           text=True, timeout=60, check=True).stdout.splitlines()
    installs = [s for s in steps if " -m pip install " in s and "torch" not in s]
    assert [s.split(" -m ", 1)[1] for s in installs] == ["pip install -q -e ."], installs
    assert any("podtrain launch local configs/demo.yaml" in s for s in steps)

    # The demo's own config, shortened, with every extra made unimportable (as after that install).
    for name in EXTRAS:
        monkeypatch.setitem(sys.modules, name, None)
    data = make_data_dir(tmp_path / "data", shard_tokens=(3000,), val_tokens=600)
    run = tmp_path / "run"
    code = main(["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={run}", "train.steps=2",
                 "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "optim.warmup_steps=1",
                 "eval.every=2", "eval.max_batches=1", "log.progress=plain"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "validation loss" in out.err + out.out and (run / "metrics.jsonl").is_file()
    assert not (run / "tb").exists()  # log.trackers=auto found no TensorBoard: metrics.jsonl only
    assert main(["sample", str(run), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()
