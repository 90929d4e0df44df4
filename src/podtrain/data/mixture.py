"""Weighted mixtures of prepared datasets (``data.mix``): the blend and its token ledger.

The picture, extending the loader's (``data/loader.py``):

* Each source keeps its own stream: position ``k`` of source ``i`` is sample
  ``perm(seed, e)[k % N_i]`` with ``e = k // N_i``, exactly once per epoch, as for one dataset.
  An up-weighted source repeats whole epochs; a down-weighted one goes on where it stopped.
* The global stream interleaves the sources by a deterministic greedy blend (as Megatron's
  ``BlendedDataset``): at every global position the source furthest behind its share is chosen,
  in the deadline-first form that provably keeps any prefix within one sample per source of the
  weights (``blend_period``). With integer weights ``W_i`` summing to ``L`` every deficit is
  back to zero after ``L`` positions, so the blend is one period of ``L`` positions repeated.
* The blend depends on the global position only, never on the world size, so a run resumes
  exactly at another world size. Its state is a **segment**: the position where the current
  weights took effect and each source's sample count there. A resume with changed weights
  (``ckpt.allow_changes=[data.mix]``) starts a new segment from the ledger: a curriculum.
* Global sample ids are the sources' ids laid end to end (source ``i``'s id ``j`` is
  ``offsets[i] + j``), so batches, the guard's skipped windows and tests name samples as before.

Everything here is a pure function of its arguments: tested without processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePosixPath
from typing import Any, Sequence

import numpy as np

from podtrain.data.manifest import Manifest, NoTokenCounts
from podtrain.errors import UserError

# The blend's period is the sum of the integer weights; weights needing a longer one are rounded
# to this resolution (1 part in 65536 of the mixture).
MAX_PERIOD = 1 << 16


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``data.mix``: a prepared dataset, its relative weight and its ledger name."""

    name: str
    path: str
    weight: float


def default_name(path: str) -> str:
    """A source's default name: its folder's name (``/data/web/`` and ``s3://b/web`` -> ``web``)."""
    return PurePosixPath(path.rstrip("/")).name or path


def parse_mix(mix: list[Any], path: str) -> list[SourceSpec]:
    """The sources of ``data.mix``, checked (one-line ``UserError`` naming the entry); an empty
    mix is ``data.path`` alone with weight 1 (the one-source shorthand)."""
    if not mix:
        return [SourceSpec(default_name(str(path)), str(path), 1.0)]
    if not isinstance(mix, list):
        raise UserError(f"config key 'data.mix' expects a list of {{path, weight, name}}, got {mix!r}")
    sources = []
    for i, entry in enumerate(mix):
        where = f"config key 'data.mix' entry {i}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: expected a mapping like {{path: DIR, weight: 1}}, got {entry!r}")
        unknown = sorted(set(entry) - {"path", "weight", "name"})
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (keys: path, weight, name)")
        src_path, weight = entry.get("path"), entry.get("weight", 1.0)
        if not isinstance(src_path, str) or not src_path:
            raise UserError(f"{where}: 'path' must name a prepared data directory, got {src_path!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (0 < weight < math.inf):
            raise UserError(f"{where} ({src_path}): 'weight' must be a positive number, got {weight!r}")
        name = entry.get("name", default_name(src_path))
        if not isinstance(name, str) or not name:
            raise UserError(f"{where} ({src_path}): 'name' must be a non-empty string, got {name!r}")
        sources.append(SourceSpec(name, src_path, float(weight)))
    names = [s.name for s in sources]
    for s in sources:
        if names.count(s.name) > 1:
            same = [o.path for o in sources if o.name == s.name]
            raise UserError(f"config key 'data.mix': sources {' and '.join(same)} are both named {s.name!r}: "
                            "give each a distinct 'name'")
    return sources


def primary_path(mix: list[Any], path: str) -> str:
    """The data directory whose tokenizer the run uses: the first source's (all share it)."""
    return mix[0]["path"] if mix and isinstance(mix[0], dict) and "path" in mix[0] else str(path)


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as the smallest integers in the same ratio, read as typed (0.7 -> 7/10).

    When their sum would exceed ``MAX_PERIOD`` they are rounded to shares of ``MAX_PERIOD``
    (largest remainders, at least 1 each).
    """
    fractions = [Fraction(str(w)) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    divisor = math.gcd(*ints)
    ints = [w // divisor for w in ints]
    if sum(ints) <= MAX_PERIOD:
        return ints
    total = float(sum(weights))
    exact = [MAX_PERIOD * w / total for w in weights]
    ints = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(ints)), key=lambda i: ints[i] - exact[i])
    for i in by_remainder[:max(0, MAX_PERIOD - sum(ints))]:
        ints[i] += 1
    divisor = math.gcd(*ints)
    return [w // divisor for w in ints]


def blend_period(weights: Sequence[int]) -> np.ndarray:
    """One period of the blend: the source chosen at each of ``L = sum(weights)`` positions.

    Greedy, deadline first (Tijdeman's chairman assignment): at position ``t`` (1-based) the
    sources that are due (share ``W_i t / L`` at least ``c_i + 1/(2K-2)``) compete and the one
    whose next sample falls furthest behind soonest wins, i.e. the least ``(c_i + s) / W_i`` with
    ``s = 1 - 1/(2K-2)`` (ties: first listed). Every prefix then holds each source within
    ``s < 1`` sample of its share, which Megatron's largest-deficit rule misses with five or more
    sources (by up to 0.05 sample: measured). Integer arithmetic, so every deficit is back to
    exactly zero at ``L`` and the period repeats.
    """
    k, total = len(weights), sum(weights)
    if k == 1:
        return np.zeros(total, dtype=np.int32)
    scale = 2 * k - 2  # fractions of a sample in units of 1/(2K-2)
    counts, period = [0] * k, np.empty(total, dtype=np.int32)
    for t in range(1, total + 1):
        best = -1
        for i in range(k):
            if weights[i] * t * scale < total * (counts[i] * scale + 1):
                continue  # not yet due
            # deadline (counts[i] * scale + scale - 1) / weights[i]: compare by cross-multiplying
            if best < 0 or ((counts[i] * scale + scale - 1) * weights[best]
                            < (counts[best] * scale + scale - 1) * weights[i]):
                best = i
        counts[best] += 1
        period[t - 1] = best
    assert counts == list(weights), "the blend did not close its period"
    return period


class Blend:
    """Global stream position -> (source, position in that source's own stream), for a segment
    of constant weights starting at stream position ``start`` with the sources' sample counts
    ``base`` there.

    ``counts(pos)`` is the ledger at any position of the segment, in O(1) after an O(L x K) table.
    """

    def __init__(self, weights: Sequence[float], start: int = 0, base: Sequence[int] | None = None):
        self.weights = integer_weights(weights)
        self.period = blend_period(self.weights)
        self.start = int(start)
        self.base = np.asarray(base if base is not None else [0] * len(self.weights), dtype=np.int64)
        onehot = np.zeros((len(self.period) + 1, len(self.weights)), dtype=np.int64)
        onehot[np.arange(1, len(self.period) + 1), self.period] = 1
        self._cum = np.cumsum(onehot, axis=0)  # _cum[r, i]: source i's samples in period[:r]

    def counts(self, pos: int) -> np.ndarray:
        """Samples each source has contributed to stream positions ``[0, pos)``."""
        if pos < self.start:
            raise ValueError(f"stream position {pos} is before this blend's segment (from {self.start})")
        full, rem = divmod(pos - self.start, len(self.period))
        return self.base + full * np.asarray(self.weights, dtype=np.int64) + self._cum[rem]

    def assign(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """For stream positions ``start .. start + count``: each one's source and its position in
        that source's own stream."""
        rel = np.arange(start - self.start, start - self.start + count, dtype=np.int64)
        source = self.period[rel % len(self.period)]
        within = np.empty(count, dtype=np.int64)
        first = self.counts(start)
        for i in range(len(self.weights)):
            mask = source == i
            within[mask] = first[i] + np.arange(int(mask.sum()), dtype=np.int64)
        return source, within


class MixOrder:
    """Stream position -> global sample id over several sources (a source order's interface).

    ``orders`` are the sources' own orders (``samples.KeyedOrder``, or ``samples.ShuffledOrder``
    for a run resumed from before it), each a pure function of (seed, epoch, position) whatever
    the others do; ``offsets`` where each source's ids begin in the global id space.
    """

    def __init__(self, orders: Sequence[Any], blend: Blend, seed: int):
        self.orders, self.blend, self.seed = list(orders), blend, seed
        self.offsets = np.concatenate([[0], np.cumsum([o.num_samples for o in self.orders])]).astype(np.int64)
        self.num_samples = int(self.offsets[-1])

    def ids(self, start: int, count: int) -> np.ndarray:
        """Global sample ids at stream positions ``start .. start + count``."""
        source, within = self.blend.assign(start, count)
        out = np.empty(count, dtype=np.int64)
        for i, order in enumerate(self.orders):
            mask = source == i
            n = int(mask.sum())
            if n:  # within a window, a source's own positions are consecutive
                out[mask] = self.offsets[i] + order.ids(int(within[mask][0]), n)
        return out


def ledger(names: Sequence[str], samples: Sequence[int], seq_len: int,
           retired: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """``{name: {"samples", "tokens"}}``: what each source has given the run (a sample is
    ``seq_len`` trained tokens); ``retired`` holds sources a curriculum dropped, frozen."""
    out = {name: {"samples": int(n), "tokens": int(n) * seq_len} for name, n in (retired or {}).items()}
    for name, n in zip(names, samples):
        out[name] = {"samples": int(n), "tokens": int(n) * seq_len}
    return out


def segment_state(names: Sequence[str], weights: Sequence[float], blend: Blend) -> dict[str, Any]:
    """The blend's state for a checkpoint (JSON-able): the weights as configured, where they took
    effect and each source's sample count there."""
    return {"weights": dict(zip(names, map(float, weights))), "start": blend.start,
            "base": {n: int(b) for n, b in zip(names, blend.base)}}


def restore_blend(names: Sequence[str], weights: Sequence[float], saved: dict[str, Any],
                  saved_ledger: dict[str, dict[str, int]], consumed: int) -> tuple[Blend, dict[str, int]]:
    """The blend to continue a checkpoint with at stream position ``consumed``, and the frozen
    sample counts of the checkpoint's sources no longer in the mix.

    The same sources and weights continue the saved segment exactly. Other weights (a changed
    ``data.mix``, which ``ckpt.allow_changes`` must allow) start a new segment at ``consumed``
    from the ledger: each source keeps its place in its own order, new sources start at zero.
    """
    retired = {n: int(entry["samples"]) for n, entry in saved_ledger.items() if n not in names}
    if saved.get("weights") == dict(zip(names, map(float, weights))):
        return Blend(weights, saved["start"], [saved["base"][n] for n in names]), retired
    base = [int(saved_ledger.get(n, {}).get("samples", 0)) for n in names]
    return Blend(weights, consumed, base), retired


def ledger_fields(entries: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """A metrics line's ledger: ``tokens_by_source`` and ``samples_by_source``."""
    return {"tokens_by_source": {n: e["tokens"] for n, e in entries.items()},
            "samples_by_source": {n: e["samples"] for n, e in entries.items()}}


def ledger_line(entries: dict[str, dict[str, int]]) -> str:
    """The run summary's ledger: ``tokens by source: web 3,072 (75.0%), code 1,024 (25.0%)``."""
    total = sum(e["tokens"] for e in entries.values()) or 1
    return "tokens by source: " + ", ".join(
        f"{n} {e['tokens']:,} ({100 * e['tokens'] / total:.1f}%)" for n, e in entries.items())


def mixed_entropy(counts: Sequence[np.ndarray], weights: Sequence[float], vocab_size: int) -> float:
    """Entropy in nats of a blend of unigram distributions: source ``i``'s token counts by id
    (``counts[i]``, ids from ``vocab_size`` on ignored), normalised, weighted by its share of the
    blend (the weights are shares of samples, all ``data.seq_len`` long, so shares of tokens too)."""
    total = float(sum(weights))
    blend = np.zeros(vocab_size, dtype=np.float64)
    for c, weight in zip(counts, weights):
        c = np.asarray(c)[:vocab_size]
        blend[:len(c)] += (weight / total) * c / max(1, c.sum())
    p = blend[blend > 0]
    return float(-(p * np.log(p)).sum())


def entropy_clause(manifests: Sequence[Manifest], weights: Sequence[float], split: str = "train") -> str:
    """The closing line's reference loss: the unigram entropy of the run's data (a ``data.mix``:
    of the blend, by weight) from the token counts ``prepare`` kept (``Manifest.token_counts``),
    so it reads no shard; data prepared before podtrain counted tokens gets a note saying how to
    get the figure instead (reading the corpus at the end of every run is what the counts avoid)."""
    try:
        counts = [m.token_counts(split) for m in manifests]
    except NoTokenCounts as exc:
        return f"n/a ({exc}; run its `podtrain prepare` command again to count them)"
    entropy = mixed_entropy(counts, weights, max(m.vocab_size for m in manifests))
    return f"{entropy:.4f} nats (a model that ignored context would sit there)"

