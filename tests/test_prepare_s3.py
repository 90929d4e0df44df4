"""``prepare --out s3://``: first steps on a real S3 server (moto's, on loopback): no credentials is
one line before any work, and another dataset under the prefix is not replaced."""

import os
import subprocess
import sys

import pytest

from test_prepare import make_corpus, run_cli


@pytest.mark.slow
def test_no_credentials_is_one_line_naming_them_before_any_work(s3_server, s3_bucket, tmp_path):
    make_corpus(tmp_path / "c", n=4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3_server.endpoint, AWS_REGION="us-east-1", HOME=str(tmp_path),
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", PODTRAIN_PREPARE_STAGING=str(tmp_path / "staging"))
    done = subprocess.run([sys.executable, "-m", "podtrain.cli", "prepare", str(tmp_path / "c"), "--out",
                           f"s3://{s3_bucket}/data", "--tokenizer", "bpe:300", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.splitlines() == [
        f"podtrain: error: s3://{s3_bucket}/data/manifest.json: no AWS credentials found (environment, "
        "AWS_PROFILE, IRSA/EKS Pod Identity, instance role)"], done.stderr  # no BPE training before it
    assert not (tmp_path / "staging").exists() and s3_server.keys(s3_bucket) == []


def test_another_dataset_under_the_prefix_is_refused_and_left_unchanged(s3_server, s3_bucket, tmp_path,
                                                                      capsys, monkeypatch):
    monkeypatch.setenv("PODTRAIN_PREPARE_STAGING", str(tmp_path / "staging"))
    make_corpus(tmp_path / "c", n=4)
    make_corpus(tmp_path / "other", n=2)
    url = f"s3://{s3_bucket}/data"
    assert run_cli([tmp_path / "c", "--out", url, "--val-fraction", "0"], capsys)[0] == 0
    before = {o["Key"]: o["ETag"] for o in s3_server.boto.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    code, err = run_cli([tmp_path / "other", "--out", url, "--val-fraction", "0"], capsys)
    assert code == 2 and err.startswith(f"podtrain: error: --out {url} holds another dataset (") and \
        "(inputs: 5 files -> 3 files): choose another --out, or pass --force" in err, err
    after = {o["Key"]: o["ETag"] for o in s3_server.boto.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert after == before and not list((tmp_path / "staging").iterdir())  # nothing staged
    assert run_cli([tmp_path / "c", "--out", url, "--val-fraction", "0"], capsys)[0] == 0  # the same: fine
