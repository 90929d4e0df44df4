"""A folder that cannot be written is named as the user gave it, never as the probe file podtrain
made up to test it (issue 30, point 10: ``export``/``plot`` said ``.podtrain-probe-...``)."""

import pytest
from test_storage_errors import read_only  # noqa: F401  (the fixture: a tmpfs mounted read-only)

from podtrain.cli import main
from podtrain.errors import storage_error
from podtrain.fsutil import writable_dir


def test_the_read_only_folder_itself_is_named(read_only, tmp_path, capsys):  # noqa: F811
    with pytest.raises(OSError) as failed:
        writable_dir(read_only)
    assert failed.value.filename == str(read_only)
    assert str(storage_error(failed.value)).startswith(f"cannot write {read_only}: ")

    assert main(["export", str(tmp_path / "run"), str(read_only / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"podtrain: error: cannot write {read_only}: ") and "\n" not in err, err
    assert ".podtrain-probe" not in err

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0, "tokens_seen": 64}\n')
    assert main(["plot", str(run), "--out", str(read_only / "curves.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"podtrain: error: cannot write {read_only}: ") and ".podtrain-probe" not in err, err
