"""Tokenizers: byte-level, locally trained BPE, Hugging Face tokenizer files on disk."""

import json

import numpy as np
import pytest

from podtrain.data import tokenizer as tokmod
from podtrain.errors import UserError

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé façade — naïve café, 日本語のテキスト, emoji 🙂\n",
    "class Foo:\n    \"\"\"A docstring.\"\"\"\n    x = [1, 2, 3]\n" * 5,
    "import os\nprint(os.path.join('a', 'b'))\n",
]


@pytest.fixture(scope="module")
def bpe() -> tokmod.HFTokenizer:
    """A small BPE trained on TEXTS (plus a little repetition so merges exist)."""
    return tokmod.train_bpe(TEXTS * 20, 300)


def test_byte_tokenizer_roundtrip_and_ids():
    tok = tokmod.ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = tok.encode("hé")
    assert ids == [104, 0xC3, 0xA9]
    assert tok.decode(ids + [tok.eos_id]) == "hé"  # EOS is dropped by decode
    assert [list(a) for a in tok.encode_batch(["ab", ""])] == [[97, 98], []]


def test_dtype_for_vocab():
    assert tokmod.dtype_for_vocab(257) == "uint16"
    assert tokmod.dtype_for_vocab(65536) == "uint16"
    assert tokmod.dtype_for_vocab(65537) == "uint32"


def test_bpe_roundtrips_text_and_compresses(bpe):
    assert bpe.vocab_size == 300
    assert bpe.eos_id == 0
    for text in TEXTS + ["unseen ✓ text with \t tabs\n\n  and spaces  "]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert all(0 < i < 300 for i in ids)  # EOS (0) never comes out of encode
    code = TEXTS[2]
    assert len(bpe.encode(code)) < len(code.encode("utf-8")) / 2  # merges were learned


def test_bpe_training_is_deterministic(bpe):
    again = tokmod.train_bpe(TEXTS * 20, 300)
    assert again.tok.to_str() == bpe.tok.to_str()


def test_literal_eos_string_stays_text(bpe):
    ids = bpe.encode("a <|endoftext|> b")
    assert bpe.eos_id not in ids
    assert bpe.decode(ids) == "a <|endoftext|> b"


def test_parse_bpe_vocab_errors():
    assert tokmod.parse_bpe_vocab("bpe:8192") == 8192
    with pytest.raises(UserError, match="bpe:x: VOCAB must be an integer"):
        tokmod.parse_bpe_vocab("bpe:x")
    with pytest.raises(UserError, match="between 258"):
        tokmod.parse_bpe_vocab("bpe:100")


def test_load_hf_from_file_and_folder(tmp_path, bpe):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(bpe.tok.to_str())
    loaded = tokmod.load_hf(str(folder / "tokenizer.json"))
    assert (loaded.tokenizer.kind, loaded.tokenizer.eos_id, loaded.tokenizer.vocab_size) == ("hf", 0, 300)
    assert set(loaded.files) == {"tokenizer.json"}
    # A folder whose tokenizer_config.json names another EOS token: that one wins.
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert tokmod.load_hf(str(folder)).files.keys() == {"tokenizer.json", "tokenizer_config.json"}
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    assert tokmod.load_hf(str(folder)).tokenizer.eos_id == bpe.tok.token_to_id("a")
    assert tokmod.load_hf(str(folder), eos_token="<|endoftext|>").tokenizer.eos_id == 0


def test_load_hf_errors(tmp_path, bpe):
    with pytest.raises(UserError, match=r"nope/here/x: no such file or directory"):
        tokmod.load_hf(str(tmp_path / "nope/here/x"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty: tokenizer folder has no tokenizer.json"):
        tokmod.load_hf(str(tmp_path / "empty"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match=r"bad.json: not a valid tokenizers JSON file"):
        tokmod.load_hf(str(bad))
    ok = tmp_path / "t.json"
    ok.write_text(bpe.tok.to_str())
    with pytest.raises(UserError, match=r"EOS token '<nope>' is not in the tokenizer's vocabulary"):
        tokmod.load_hf(str(ok), eos_token="<nope>")


def test_hf_tokenizer_without_known_eos_is_a_user_error(tmp_path):
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str())
    with pytest.raises(UserError, match="cannot tell the EOS token.*pass --eos-token"):
        tokmod.load_hf(str(path))


def test_byte_encode_batch_is_uint8_view():
    arrs = tokmod.ByteTokenizer().encode_batch(["xyz"])
    assert arrs[0].dtype == np.uint8 and arrs[0].tolist() == [120, 121, 122]


def test_a_tokenizer_identity_compares_by_its_hash_and_old_checkpoints_still_resume():
    from podtrain.config import load_config
    from podtrain.data.manifest import said_once, tokenizer_identity
    from podtrain.train.resume import check_resume

    sha = "81689b37afb4" + "0" * 52
    trained = tokenizer_identity({"kind": "bpe", "name": "bpe:4096", "vocab_size": 4096, "sha256": sha})
    loaded = tokenizer_identity({"kind": "hf", "name": "data/stdtest/tokenizer", "vocab_size": 4096, "sha256": sha})
    other = tokenizer_identity({"kind": "bpe", "name": "bpe:4096", "vocab_size": 4096, "sha256": "9" * 64})
    assert (str(trained), str(loaded)) == ("bpe:4096:81689b37afb4", "hf:data/stdtest/tokenizer:4096:81689b37afb4")
    assert trained == loaded and not trained != loaded and hash(trained) == hash(loaded)  # one tokenizer
    assert trained != other and loaded != "bpe:4096:999999999999"
    assert tokenizer_identity({"kind": "byte", "name": "byte", "vocab_size": 257}) != "byte:300"  # no hash: the text
    assert json.dumps({"tokenizer": loaded}) == '{"tokenizer": "hf:data/stdtest/tokenizer:4096:81689b37afb4"}'

    cfg = load_config(None, [])
    config = {"data": {"seq_len": cfg.data.seq_len}}
    # Checkpoints of every podtrain so far: the same tokenizer now loaded from a path resumes.
    for stored in ("bpe:4096:81689b37afb4", "bpe:bpe:4096:4096:81689b37afb4"):
        check_resume({"config": config, "tokenizer": stored}, cfg, loaded, 3, "ckpt/step_3")
        assert said_once(stored) == loaded
    with pytest.raises(UserError, match=r"data.tokenizer was 'bpe:4096:81689b37afb4', now 'bpe:4096:999999999999'"):
        check_resume({"config": config, "tokenizer": "bpe:4096:81689b37afb4"}, cfg, other, 3, "ckpt/step_3")
