"""``podtrain prepare`` as a newcomer meets it (issue 38, "Second day"): a mistyped tokenizer path
read as a Hub id fails fast in one line with a suggestion, a refusal to train over a tokenizer
names only what differs, duplicate inputs and compressed sizes are said, and one unit for
``--bpe-train-bytes``."""

import gzip
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from test_prepare import make_corpus, run_cli

from podtrain import cli
from podtrain.data.tokenizer import train_bpe

HUB_DEADLINE_S = 8.0  # "a few seconds" (before: 25-30 s of huggingface_hub retries)


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_subprocess(cwd: Path, args: list[str], endpoint: str) -> tuple[int, str, float]:
    """``podtrain prepare ARGS`` in a fresh process (huggingface_hub reads HF_ENDPOINT at import),
    with the Hub at ``endpoint`` and no proxy; returns (exit code, stderr, seconds)."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("https_proxy", "http_proxy", "all_proxy", "hf_hub_offline")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(cwd / ".hf"), PYTHONPATH=os.pathsep.join(sys.path))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "podtrain.cli", "prepare", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=90)
    return done.returncode, done.stderr, time.monotonic() - t0


def tokenizer_tree(root: Path) -> None:
    """``root/data/tok/tokenizer.json`` (a tiny BPE) and a corpus ``root/c``."""
    (root / "data/tok").mkdir(parents=True)
    tok = train_bpe(["hello world, hello tokenizer\n"] * 20, 300)
    (root / "data/tok/tokenizer.json").write_text(tok.tok.to_str())
    (root / "c").mkdir()
    (root / "c/a.txt").write_text("some text\n")


def test_a_hub_id_without_network_fails_fast_in_one_line_with_did_you_mean(tmp_path):
    tokenizer_tree(tmp_path)
    args = ["c", "--out", "d", "--tokenizer", "dat/tok", "--no-progress", "--workers", "1"]
    port = closed_port()
    for endpoint, why in ((f"http://127.0.0.1:{port}", f"cannot reach http://127.0.0.1:{port}: Connection refused"),
                          ("http://podtrain-no-such-host.invalid",
                           "cannot reach http://podtrain-no-such-host.invalid: podtrain-no-such-host.invalid "
                           "does not resolve")):
        code, err, secs = prepare_subprocess(tmp_path, args, endpoint)
        assert code == 2, err
        assert secs < HUB_DEADLINE_S, (secs, err)
        assert err.count("\n") == 1 and "huggingface" not in err.lower().replace("hugging face hub", ""), err
        assert err.startswith("podtrain: error: --tokenizer dat/tok: not a local path, and loading it from the "
                              f"Hugging Face Hub failed ({why}"), err
        assert err.endswith("); did you mean data/tok? (write ./dat/tok for a local path)\n"), err
        assert not (tmp_path / "d").exists()


class _NotFound(http.server.BaseHTTPRequestHandler):
    """A Hub that knows no repository: 404 to everything."""

    def _404(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _404

    def log_message(self, *args) -> None:
        pass


def test_a_hub_that_answers_no_repository_is_one_line_without_hub_log_lines(tmp_path):
    """The Hub reached (a local server answering 404): huggingface_hub is called, and its log
    lines do not reach the terminal; far from any local path, no suggestion."""
    tokenizer_tree(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        for name, hint in (("dat/tok", "; did you mean data/tok? (write ./dat/tok for a local path)"),
                           ("someorg/model-x", "")):
            code, err, secs = prepare_subprocess(
                tmp_path, ["c", "--out", "d", "--tokenizer", name, "--no-progress"], endpoint)
            assert code == 2 and secs < HUB_DEADLINE_S, (code, secs, err)
            lines = err.splitlines()
            assert len(lines) == 1, err
            assert lines[0].startswith(f"podtrain: error: --tokenizer {name}: not a local path, and loading it "
                                       "from the Hugging Face Hub failed ("), err
            assert lines[0].endswith(")" + hint), err
    finally:
        server.shutdown()
        server.server_close()


def test_train_tokenizer_only_refusal_names_only_what_differs(tmp_path, capsys):
    make_corpus(tmp_path / "a", n=4)
    make_corpus(tmp_path / "b", n=1)
    tok = tmp_path / "tok"
    train = ["--out", tok, "--tokenizer", "bpe:300", "--train-tokenizer-only"]
    assert run_cli([tmp_path / "a", *train], capsys)[0] == 0
    head = f"podtrain: error: --out {tok} holds a tokenizer ('bpe:300', {tok / 'tokenizer/tokenizer.json'}) trained "
    tail = f"would replace it under the datasets prepared with --tokenizer {tok}: choose another --out, or pass " \
        "--force to replace it"

    # The same inputs, another vocabulary.
    assert run_cli([tmp_path / "a", *train[:3], "bpe:280", train[4]], capsys) == \
        (2, head + "differently (vocabulary 300 -> 280); training bpe:280 " + tail)
    # Other inputs (5 files -> 2 files: make_corpus adds a large file).
    assert run_cli([tmp_path / "b", *train], capsys) == \
        (2, head + "differently (inputs: 5 files -> 2 files); training bpe:300 " + tail)
    # The same number of files: the first input that differs.
    make_corpus(tmp_path / "a2", n=4)
    assert run_cli([tmp_path / "a2", *train], capsys) == \
        (2, head + f"differently (inputs: {tmp_path / 'a'} -> {tmp_path / 'a2'}); training bpe:300 " + tail)
    # An option.
    assert run_cli([tmp_path / "a", *train, "--bpe-train-bytes", "5000"], capsys) == \
        (2, head + "differently (options: --bpe-train-bytes 268435456 -> 5000); training bpe:300 " + tail)


def test_train_tokenizer_only_over_a_dataset_names_only_what_differs(tmp_path, capsys):
    """Over a dataset prepared with the tokenizer of another (``--tokenizer DATA_DIR``): the same
    name ``bpe:300`` on both sides, so the refusal says what does differ."""
    make_corpus(tmp_path / "a", n=4)
    make_corpus(tmp_path / "b", n=1)
    assert run_cli([tmp_path / "a", "--out", tmp_path / "tok", "--tokenizer", "bpe:300",
                    "--train-tokenizer-only"], capsys)[0] == 0
    d = tmp_path / "d"
    assert run_cli([tmp_path / "b", "--out", d, "--tokenizer", tmp_path / "tok", "--val-fraction", "0"],
                   capsys)[0] == 0
    manifest = json.loads((d / "manifest.json").read_text())
    sha = manifest["tokenizer"]["sha256"][:12]
    tokens = manifest["splits"]["train"]["tokens"]
    code, err = run_cli([tmp_path / "a", "--out", d, "--tokenizer", "bpe:300", "--train-tokenizer-only",
                         "--val-fraction", "0"], capsys)
    assert (code, err) == (2, f"podtrain: error: --out {d} holds another dataset ({tokens:,} tokens from "
                              f"{tmp_path / 'b'} (2 files), tokenizer 'bpe:300'); this prepare would replace it "
                              f"with {tmp_path / 'a'} (5 files), tokenizer 'bpe:300' (inputs: 2 files -> 5 files, "
                              f"tokenizer sha256:{sha} -> bpe:300): choose another --out, or pass --force to "
                              "replace it")


def test_duplicate_inputs_are_read_once_and_said(tmp_path, capsys):
    """As /usr/share/doc/<pkg> symlinks to another package's folder: a glob reaches one file twice."""
    pkgs = tmp_path / "doc"
    for name in ("a", "b", "c"):
        (pkgs / name).mkdir(parents=True)
        (pkgs / name / "copyright").write_text(f"copyright of package {name}\n")
    (pkgs / "a-dev").symlink_to("a")
    (pkgs / "c-doc").symlink_to(pkgs / "c")
    (pkgs / "c-data").symlink_to("c")
    assert cli.main(["prepare", str(pkgs / "*" / "copyright"), "--out", str(tmp_path / "d"),
                     "--val-fraction", "0", "--no-progress", "--workers", "1"]) == 0
    line = capsys.readouterr().out.strip()
    # Sorted matches: a-dev/, a/, b/, c-data/, c-doc/, c/: the first of each real file is read
    # (3 x 23 bytes + EOS).
    assert "train 72 tokens / 3 docs / 1 shards;" in line, line
    assert line.endswith("; skipped 3 duplicates (the same file as another input: a/copyright, "
                         "c-doc/copyright, c/copyright)"), line
    # An INPUT named twice is one too (and a file named once: no note).
    assert cli.main(["prepare", str(pkgs / "b/copyright"), str(pkgs / "b/copyright"), "--out",
                     str(tmp_path / "d2"), "--val-fraction", "0", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().endswith(
        "; skipped 1 duplicate (the same file as another input: copyright)")


def test_compressed_inputs_report_the_text_size_and_speed(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    text = "".join(f"line {i} of a compressible changelog entry\n" for i in range(8000))
    raw = gzip.compress(text.encode())
    (tmp_path / "c/changelog.gz").write_bytes(raw)
    assert cli.main(["prepare", str(tmp_path / "c"), "--out", str(tmp_path / "d"), "--val-fraction", "0",
                     "--no-progress", "--workers", "1"]) == 0
    line = capsys.readouterr().out.strip()
    m = re.match(rf"prepared {re.escape(str(tmp_path / 'd'))}: (\S+) MB read \((\S+) MB of text\) in (\S+)s "
                 r"\((\S+) MB/s\); ", line)
    assert m, line
    assert (m.group(1), m.group(2)) == (f"{len(raw) / 1e6:.1f}", f"{len(text) / 1e6:.1f}") == ("0.0", "0.4")
    assert float(m.group(4)) > 0
    # Plain text: one size, as before.
    (tmp_path / "p").mkdir()
    (tmp_path / "p/a.txt").write_text(text)
    assert cli.main(["prepare", str(tmp_path / "p"), "--out", str(tmp_path / "d2"), "--val-fraction", "0",
                     "--no-progress", "--workers", "1"]) == 0
    assert re.match(r"prepared \S+: 0\.4 MB in \S+s \(\S+ MB/s\); ", capsys.readouterr().out), line


def test_bpe_train_bytes_is_in_mib_everywhere(tmp_path, capsys, repo):
    make_corpus(tmp_path / "a", n=2)
    assert cli.main(["prepare", str(tmp_path / "a"), "--out", str(tmp_path / "t"), "--tokenizer", "bpe:300",
                     "--train-tokenizer-only", "--no-progress", "--workers", "1"]) == 0
    assert capsys.readouterr().err.strip() == "prepare: training bpe:300 on up to 256 MiB of train text"
    assert cli.main(["prepare", str(tmp_path / "a"), "--out", str(tmp_path / "t2"), "--tokenizer", "bpe:300",
                     "--train-tokenizer-only", "--bpe-train-bytes", "5000", "--no-progress"]) == 0
    assert capsys.readouterr().err.strip() == "prepare: training bpe:300 on up to 5,000 bytes of train text"
    docs = (repo / "docs/data.md").read_text()
    assert "`--bpe-train-bytes` (268435456 bytes = 256 MiB" in docs and "(256 MB)" not in docs
