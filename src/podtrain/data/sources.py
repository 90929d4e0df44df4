"""The prepared datasets one run reads: ``data.path``, or every source of ``data.mix``.

``DataSources`` opens each source's manifest, refuses sources prepared with different tokenizers
(one line naming both and the command that fixes it), checks the ids against the model's vocabulary and cuts each split into
samples (``SampleIndex``). ``MixedIndex`` lays the sources' samples end to end in one global id
space, which the blend (``data/mixture.py``) draws from.

At job scale the start must not send S3 a request per rank: ``shared_manifests`` has rank 0 read
every S3 source once (one paged LIST of its prefix and one GET of its manifest, for all splits
and ``data.verify`` together) and hands the result to every rank in one broadcast, so the
requests at start are the same at 1 rank and at 512 (512 ranks listing one prefix in the same
second would be throttled: S3 serves a few thousand requests per second per prefix).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from podtrain.data.cache import BlockCache, CacheSpec
from podtrain.data.manifest import MANIFEST_NAME, Manifest, check_vocab, read_manifest, same_tokenizer, \
    tokenizer_identity, verify_shards
from podtrain.data.mixture import SourceSpec, parse_mix
from podtrain.data.samples import SampleIndex
from podtrain.distributed.env import ClusterEnv
from podtrain.errors import UserError
from podtrain.storage import is_s3_url

if TYPE_CHECKING:
    from podtrain.distributed.group import DistContext


def check_one_tokenizer(specs: Sequence[SourceSpec], manifests: Sequence[Manifest]) -> None:
    """Refuse sources prepared with different tokenizers (by content: ``same_tokenizer``), naming
    both sources and tokenizers and the command that prepares the second with the first's."""
    first = manifests[0].tokenizer
    for spec, manifest in zip(specs[1:], manifests[1:]):
        if not same_tokenizer(manifest.tokenizer, first):
            raise UserError(
                f"data.mix: {specs[0].path} was prepared with tokenizer {tokenizer_identity(first)} but "
                f"{spec.path} with {tokenizer_identity(manifest.tokenizer)}: every source must use one "
                f"tokenizer; prepare {spec.path} again with {specs[0].path}'s: "
                f"`{reprepare_command(manifest, specs[0].path)}`")


def reprepare_command(manifest: Manifest, tokenizer_from: str) -> str:
    """The ``podtrain prepare`` command that remakes ``manifest``'s dataset (its inputs, split, text
    field and --errors policy) with the tokenizer of the dataset ``tokenizer_from``, replacing it
    (``--force``). The inputs are as its manifest records them (relative to where it was made)."""
    raw = manifest.raw
    inputs = [str(s["input"]) for s in raw.get("sources") or []] or ["INPUT..."]
    words = ["podtrain", "prepare", *inputs, "--out", str(manifest.root), "--tokenizer", tokenizer_from]
    if raw.get("val_fraction") is not None:
        words += ["--val-fraction", f"{raw['val_fraction']:g}"]
    if raw.get("text_field", "text") != "text":
        words += ["--text-field", str(raw["text_field"])]
    if (raw.get("errors") or {}).get("policy", "strict") != "strict":
        words += ["--errors", str(raw["errors"]["policy"])]
    return " ".join(w if w == "INPUT..." else shlex.quote(w) for w in words) + " --force"


def read_remote_manifests(specs: Sequence[SourceSpec]) -> list[Manifest | None]:
    """The manifests of the S3 sources, each listed with its directory's file sizes (one LIST and
    one GET per distinct prefix); None for a local source (each rank reads its own disk: node-local
    copies must be checked on every node)."""
    read: dict[str, Manifest] = {}
    for spec in specs:
        if is_s3_url(spec.path) and spec.path not in read:
            read[spec.path] = read_manifest(spec.path, list_files=True)
    return [read.get(spec.path) for spec in specs]


def shared_manifests(data: Any, ctx: "DistContext") -> list[Manifest | None]:
    """Every rank: the manifests of ``data``'s S3 sources (``read_remote_manifests``) as rank 0
    read them, in ``data.mix`` order (``DataSources.from_config``'s ``manifests``). Rank 0 alone
    sends requests; one broadcast hands them to all ranks (``ctx``: the job's ``DistContext``; one
    process: read here). A failure on rank 0 (a missing manifest, a missing bucket) raises on every
    rank (``DistContext.agree_on``), so none waits in the broadcast."""
    specs = parse_mix(data.mix, data.path)
    if not any(is_s3_url(spec.path) for spec in specs):
        return [None] * len(specs)  # nothing to share: no collective (every rank decides alike)
    mine = ctx.agree_on(lambda: read_remote_manifests(specs) if ctx.is_main else None)
    return ctx.broadcast_object(mine)


class MixedIndex:
    """Several ``SampleIndex``es as one: source ``i``'s sample ``j`` has global id ``offsets[i] + j``."""

    def __init__(self, indexes: Sequence[SampleIndex]):
        self.indexes = list(indexes)
        self.seq_len = self.indexes[0].seq_len
        self.offsets = np.concatenate([[0], np.cumsum([ix.num_samples for ix in self.indexes])]).astype(np.int64)
        self.num_samples = int(self.offsets[-1])

    def _by_source(self, ids: np.ndarray):
        """``(source, mask)`` for each source the global ids fall in."""
        source = np.searchsorted(self.offsets, ids, side="right") - 1
        for i in np.unique(source):
            yield int(i), source == i

    def warm(self, ids: np.ndarray) -> None:
        """Start reading these samples ahead (``SampleIndex.warm``)."""
        for i, mask in self._by_source(ids):
            self.indexes[i].warm(ids[mask] - self.offsets[i])

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``seq_len + 1`` token ids (int64) for global sample ids, in the given order."""
        if len(self.indexes) == 1:
            return self.indexes[0].gather(ids)
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for i, mask in self._by_source(ids):
            out[mask] = self.indexes[i].gather(ids[mask] - self.offsets[i])
        return out


class DataSources:
    """The sources of a run with their manifests and the samples of ``split`` in each.

    Args:
        specs: the sources (``parse_mix``).
        seq_len: tokens per training sequence.
        split: the split to cut into samples (``train``).
        manifests: already-read manifests, in ``specs`` order (``shared_manifests``); a source
            without one (None, or no list) is read here, an S3 one with its listing.
    """

    def __init__(self, specs: Sequence[SourceSpec], seq_len: int, split: str = "train",
                 manifests: Sequence[Manifest | None] | None = None):
        self.specs = list(specs)
        self.seq_len = seq_len
        given = list(manifests) if manifests is not None else [None] * len(self.specs)
        self.manifests = [m if m is not None else read_manifest(s.path, list_files=True)
                          for s, m in zip(self.specs, given)]
        check_one_tokenizer(self.specs, self.manifests)
        self.indexes = [SampleIndex(m, split, seq_len) for m in self.manifests]
        self.vocab_limit: int | None = None  # the model's vocabulary, once check_vocab has run
        self.cache: BlockCache | None = None
        self.use_cache(CacheSpec("", 0))  # S3 blocks are read through a cache that keeps none

    @classmethod
    def from_config(cls, data, split: str = "train",
                    manifests: Sequence[Manifest | None] | None = None) -> "DataSources":
        """The sources of a ``DataSection``: ``data.mix``, else ``data.path`` alone; S3 sources are
        cached under ``data.cache_dir`` within ``data.cache_gb`` per node. ``manifests``: what
        ``shared_manifests`` handed this rank (a job's start: no request of its own)."""
        sources = cls(parse_mix(data.mix, data.path), data.seq_len, split, manifests)
        env = ClusterEnv.detect()
        sources.use_cache(CacheSpec(data.cache_dir, int(data.cache_gb * 1e9), env.local_rank, env.local_world_size))
        return sources

    def use_cache(self, spec: CacheSpec) -> None:
        """Read S3 shards through one block cache under ``spec`` (every split of every source)."""
        if self.cache is not None:
            self.cache.close()
        self.cache = BlockCache(spec)
        for index in self.indexes:
            index.tokens.cache = self.cache

    def close(self) -> None:
        """Release the block cache's threads and S3 stores (the loader's end; reading again reopens them)."""
        self.cache.close()

    @property
    def names(self) -> list[str]:
        """The sources' ledger names, in ``data.mix`` order."""
        return [s.name for s in self.specs]

    @property
    def weights(self) -> dict[str, float]:
        """``{name: weight}`` as configured."""
        return {s.name: s.weight for s in self.specs}

    def by_source(self, field: str, values: dict[str, float]) -> dict[str, dict[str, float]]:
        """``{f"{field}_by_source": values}`` for a mixture; nothing for one source (its value is
        the run's own)."""
        return {f"{field}_by_source": values} if len(self.specs) > 1 else {}

    @property
    def manifest(self) -> Manifest:
        """The first source's manifest (all share its tokenizer)."""
        return self.manifests[0]

    def check_vocab(self, model_vocab_size: int) -> None:
        """Every source's tokenizer and recorded ``max_token_id`` fit the model's vocabulary;
        then every batch read is checked against it too (``SampleIndex.vocab_limit``)."""
        for manifest in self.manifests:
            check_vocab(manifest, model_vocab_size)
        self.vocab_limit = model_vocab_size
        for index in self.indexes:
            index.vocab_limit = model_vocab_size

    def verify(self, part: tuple[int, int] = (0, 1)) -> None:
        """Check shard sizes and checksums of every source (``verify_shards``'s ``part``); the
        sizes are the manifests' listings (no LIST), the checksums read this rank's part."""
        for manifest in self.manifests:
            verify_shards(manifest, part=part)

    def val_indexes(self) -> dict[str, SampleIndex]:
        """``{name: SampleIndex}`` of the validation split of each source that has one."""
        indexes = {spec.name: SampleIndex(m, "val", self.seq_len)
                   for spec, m in zip(self.specs, self.manifests) if "val" in m.splits()}
        for index in indexes.values():
            index.vocab_limit = self.vocab_limit
            index.tokens.cache = self.cache
        return indexes

    def describe(self) -> str:
        """``web (/data/web, weight 3), code (/data/code, weight 1)``; one source: its path."""
        if len(self.specs) == 1:
            return self.specs[0].path
        return ", ".join(f"{s.name} ({s.path}, weight {s.weight:g})" for s in self.specs)

    def manifest_path(self, i: int) -> str:
        """Where source ``i``'s manifest is (for messages)."""
        return str(self.manifests[i].root / MANIFEST_NAME)
