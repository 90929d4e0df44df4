"""The closing line's reference loss for a data.mix is the entropy of the blend, by weight."""

import math

import numpy as np

from podtrain.data.loader import blend_entropy, unigram_entropy
from podtrain.data.manifest import read_manifest
from synthetic_data import make_data_dir


def _source(root, token: int, n: int = 600):
    """A dataset whose training tokens are all ``token`` (entropy 0 on its own)."""
    data = make_data_dir(root, shard_tokens=(n,), val_tokens=50)
    np.full(n, token, dtype=np.uint16).tofile(data / "train_00000.bin")
    return read_manifest(data)


def test_the_blend_entropy_weighs_each_source_and_is_not_the_first_sources(tmp_path):
    a, b = _source(tmp_path / "a", 3), _source(tmp_path / "b", 7)
    assert unigram_entropy(a) == 0.0  # what main printed for any mix whose first source is a
    # 3 parts of a, 1 part of b: p = (0.75, 0.25)
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert abs(blend_entropy([a, b], [3.0, 1.0]) - expected) < 1e-12
    assert abs(blend_entropy([a, b], [1.0, 1.0]) - math.log(2)) < 1e-12
    assert blend_entropy([a], [1.0]) == unigram_entropy(a)
