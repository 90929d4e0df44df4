"""Issue 30 point 10: `train` without arguments names only what is missing, and the settings that
run but are rarely meant get one warning line each (not an error)."""

import logging

import torch

from podtrain.cli import main
from podtrain.config import load_config
from podtrain.launch.local import oversubscription, usable_cores


def test_train_without_arguments_asks_for_the_config_only(capsys):
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert err == ("podtrain: error: podtrain train: missing config: YAML config file (see configs/demo.yaml); "
                   "`podtrain train --help` shows every option\n")  # overrides are optional: not named


def test_more_local_ranks_than_cores_is_one_warning_line(repo, capsys):
    assert oversubscription(2, 2) is None
    assert oversubscription(8, 2) == ("8 ranks on 2 core(s) here: ranks beyond one per core take turns on "
                                      "them, so each step is slower than with 2 rank(s)")
    cores = usable_cores()
    # The warning comes first; the job is then refused for its batch (a prime over cores + 1 ranks).
    code = main(["launch", "local", str(repo / "configs/demo.yaml"), "--nproc", str(cores + 1),
                 "train.micro_batch_size=1", "train.global_batch_size=1000003"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 2, err
    assert err[0] == f"podtrain: warning: {oversubscription(cores + 1, cores)}"
    assert err[1].startswith("podtrain: error: train.global_batch_size=1000003 is not divisible")


def test_a_warmup_as_long_as_the_run_is_one_warning_line_from_rank_0(repo, tmp_path, caplog):
    from synthetic_data import make_data_dir
    from podtrain.train.preflight import check_run

    data = make_data_dir(tmp_path / "data", shard_tokens=(2000,), val_tokens=400)
    base = [f"data.path={data}", "data.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=1",
            "train.steps=10", "eval.every=0"]
    with caplog.at_level(logging.INFO, logger="podtrain"):
        check_run(load_config(repo / "configs/demo.yaml", [*base, "optim.warmup_steps=9"]), 1, 1, torch.device("cpu"))
        assert not [r for r in caplog.records if "warmup" in r.getMessage()]
        check_run(load_config(repo / "configs/demo.yaml", [*base, "optim.warmup_steps=20"]), 1, 1, torch.device("cpu"))
    (warning,) = [r for r in caplog.records if "warmup" in r.getMessage()]
    # INFO: only rank 0 logs it (the other ranks log WARNING and above), so a job says it once.
    assert warning.levelno == logging.INFO
    assert warning.getMessage() == (
        "warning: optim.warmup_steps=20 >= train.steps=10: the run ends inside its warmup, the learning rate "
        "reaching 50% of optim.lr=0.003 at its last step and never decaying; lower optim.warmup_steps (a few % "
        "of train.steps is usual)")


def test_the_command_and_python_m_end_through_console_main_with_mains_exit_code():
    """`podtrain` (the console script) and `python -m podtrain.cli` (every rank) exit through
    ``console_main``, which freezes the collector before the interpreter's shutdown walk (~0.5 s
    of CPU per rank), and keep ``main``'s exit code and one-line error."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "podtrain"]
    assert script.value == "podtrain.cli:console_main"
    # What the shutdown sees (an atexit handler runs before its last collection): the objects frozen.
    probe = ("import atexit, gc, sys; atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0)); "
             "sys.argv = ['podtrain', 'train', '/nonexistent/run.yaml']; "
             "from podtrain.cli import console_main; console_main()")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "podtrain: error: config file /nonexistent/run.yaml does not exist\n"
    assert done.stdout == "frozen at exit: True\n"
