"""Config: YAML + dotted overrides; user mistakes give one line and exit code 2."""

import subprocess
import sys

import pytest
import yaml

from podtrain.cli import main
from podtrain.config import accumulation_steps, dump_config, load_config, to_dict
from podtrain.errors import UserError


def test_overrides_apply_with_types(repo):
    cfg = load_config(repo / "configs/demo.yaml", ["optim.lr=3e-4", "train.steps=200", "train.compile=true"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 200 and cfg.train.compile is True
    assert cfg.model.preset == "tiny"  # from the file


@pytest.mark.parametrize("override, expected", [
    ("optim.lrr=1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("train.lr=1", "unknown config key 'train.lr' (did you mean 'optim.lr'?)"),
    ("train.steps=abc", "config key 'train.steps' expects an integer, got 'abc'"),
    ("train.compile=1", "config key 'train.compile' expects true or false, got 1"),
    ("train.precision=fp8", "config key 'train.precision' must be one of auto, fp32, bf16, fp16, got 'fp8'"),
    ("steps", "override 'steps' must look like section.key=value"),
])
def test_user_mistakes_name_the_key(override, expected):
    with pytest.raises(UserError) as info:
        load_config(None, [override])
    assert str(info.value) == expected


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(UserError, match=r"unknown config key 'train.stepz' \(did you mean 'train.steps'\?\)"):
        load_config(path)


@pytest.mark.parametrize("key, meant", [
    ("optim.learning_rate", "optim.lr"),  # a synonym, not the nearest spelling (optim.min_lr)
    ("train.batch_size", "train.global_batch_size"),
    ("optim.lr_min", "optim.min_lr"),  # the same words in another order
    ("data.seq_length", "data.seq_len"),
    ("train.max_grad_norm", "train.grad_clip"),
    ("optim.weight_decy", "optim.weight_decay"),  # a close spelling within the section
    ("modle.preset", "model.preset"),  # a close spelling of the section
    ("learning_rate", "optim.lr"),  # a top-level key in a YAML file
])
def test_a_mistyped_key_gets_the_key_it_means(key, meant):
    with pytest.raises(UserError) as info:
        load_config(None, [f"{key}=1"])
    assert str(info.value) == f"unknown config key {key!r} (did you mean {meant!r}?)"


def test_a_key_nothing_is_close_to_lists_what_there_is():
    from podtrain.config import SYNONYMS, all_keys

    assert set(SYNONYMS.values()) <= set(all_keys())
    with pytest.raises(UserError) as info:
        load_config(None, ["optim.foo=1"])
    assert str(info.value) == ("unknown config key 'optim.foo' (optim has: lr, min_lr, warmup_steps, schedule, "
                               "decay_fraction, weight_decay, beta1, beta2, eps, implementation)")
    with pytest.raises(UserError, match=r"'train.gradient_accumulation_steps': gradient accumulation follows "
                                        r"from train.global_batch_size / \(train.micro_batch_size x world size\)"):
        load_config(None, ["train.gradient_accumulation_steps=4"])


def test_accumulation_must_divide():
    assert accumulation_steps(32, 8, 2) == 2
    with pytest.raises(UserError, match="global_batch_size=32 is not divisible by .* 8 x 3 = 24"):
        accumulation_steps(32, 8, 3)


@pytest.mark.slow
def test_cli_prints_one_line_and_exits_2(repo):
    proc = subprocess.run([sys.executable, "-m", "podtrain.cli", "train", str(repo / "configs/demo.yaml"),
                           "optim.lrr=3e-4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "podtrain: error: unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_launch_local_rejects_indivisible_accumulation_before_starting(repo, capsys):
    code = main(["launch", "local", str(repo / "configs/demo.yaml"), "--nproc", "3"])
    assert code == 2
    assert "not divisible" in capsys.readouterr().err


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=7", "ckpt.signals=[SIGTERM]"])
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert to_dict(again) == to_dict(cfg)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 7


def test_override_values_are_parsed_by_the_key_type(tmp_path):
    # YAML 1.1 would read these as booleans/null; the key's type decides instead.
    cfg = load_config(None, ["log.progress=off", "ckpt.resume=never", "model.vocab_size=null", "log.every=5"])
    assert (cfg.log.progress, cfg.ckpt.resume, cfg.model.vocab_size, cfg.log.every) == ("off", "never", None, 5)
    path = tmp_path / "c.yaml"
    path.write_text("log:\n  progress: off\n")
    assert load_config(path).log.progress == "off"


def test_signal_names_use_the_runtime_parser():
    assert load_config(None, ["ckpt.signals=[USR1, 15]"]).ckpt.signals == ["USR1", "15"]
    with pytest.raises(UserError, match="config key 'ckpt.signals': SIGKILL cannot be caught"):
        load_config(None, ["ckpt.signals=[SIGKILL]"])
    with pytest.raises(UserError, match="'eval.max_batches' must be at least 1"):
        load_config(None, ["eval.max_batches=0"])
