"""One collective on one message size: its buffers, its expected result, the check and the timing.

Each case fills its inputs with the check pattern of ``busbw`` ((3r + i) mod 11 on rank r), runs
the collective once, counts the elements that differ from the expected result, then times the bare
call. Fills and checks work in slices of ``_CHUNK`` elements, so no index tensor of the message's
full size is ever built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from podtrain.diagnostics.busbw import OPS, PATTERN_MOD, element_counts, pattern, sum_table
from podtrain.errors import UserError

_CHUNK = 1 << 24  # elements per fill/check slice, which bounds the check's extra memory


@dataclass
class Case:
    """Buffers and the call for one (op, size): ``call()`` runs the collective once."""

    op: str
    call: Callable[[], Any]
    output: torch.Tensor
    expected: Callable[[torch.Tensor], torch.Tensor]  # global output index -> expected values
    nbytes: int
    impl: str = "native"
    reset: Callable[[], None] = lambda: None  # put the buffers in their timing state

    def check(self, tol: float) -> int:
        """Elements of the output further than ``tol`` from the expected result."""
        return count_wrong(self.output, self.expected, tol)


def _fill(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``t[i] = fn(i)`` slice by slice, so no index tensor of the full size is ever built."""
    flat = t.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        stop = min(start + _CHUNK, flat.numel())
        idx = torch.arange(start, stop, device=t.device, dtype=torch.int64)
        flat[start:stop] = fn(idx).to(t.dtype)
    return t


def count_wrong(out: torch.Tensor, expected: Callable[[torch.Tensor], torch.Tensor],
                tol: float) -> int:
    """Elements of ``out`` further than ``tol`` from ``expected(index)``, slice by slice."""
    flat = out.view(-1)
    wrong = 0
    for start in range(0, flat.numel(), _CHUNK):
        stop = min(start + _CHUNK, flat.numel())
        idx = torch.arange(start, stop, device=out.device, dtype=torch.int64)
        diff = (flat[start:stop].double() - expected(idx).double()).abs()
        wrong += int((~(diff <= tol)).sum())  # NaN counts as wrong
    return wrong


def native_collective(name: str, old: str) -> Callable[..., Any] | None:
    """``torch.distributed.<name>``, or ``<old>`` where only that exists (None if neither)."""
    # torch 2.13 renamed the *_tensor collectives to *_single; older releases have only the old.
    return getattr(dist, name, None) or getattr(dist, old, None)


def build_case(op: str, nbytes: int, dtype: torch.dtype, device: torch.device, group: Any,
               rank: int, n: int, src: int, fallback_rs: bool = False) -> Case:
    """Allocate and fill the buffers of ``op`` for a message of about ``nbytes``.

    ``rank`` is this rank's index in ``group`` (n ranks); ``src`` the global rank broadcasting.
    """
    es = torch.empty((), dtype=dtype).element_size()
    total, per = element_counts(op, nbytes, es, n)
    mk = lambda count, fill: torch.full((count,), fill, dtype=dtype, device=device)  # noqa: E731
    if op == "all_reduce":
        buf = _fill(mk(total, 0), lambda i: pattern(rank, i))
        table = sum_table(n).to(device)
        return Case(op, lambda: dist.all_reduce(buf, group=group), buf,
                    lambda i: table[i % PATTERN_MOD], total * es,
                    # in place: zeros keep repeated sums finite (no overflow to inf in fp16)
                    reset=buf.zero_)
    if op == "broadcast":
        # Non-source ranks start at -1 so a message that never arrived is seen as wrong.
        buf = _fill(mk(total, 0), lambda i: pattern(0, i)) if rank == 0 else mk(total, -1)
        return Case(op, lambda: dist.broadcast(buf, src=src, group=group), buf,
                    lambda i: pattern(0, i), total * es)
    if op == "all_gather":
        inp = _fill(mk(per, 0), lambda i: pattern(rank, i))
        out = mk(total, -1)
        gather = native_collective("all_gather_single", "all_gather_into_tensor")
        return Case(op, lambda: gather(out, inp, group=group), out,
                    lambda i: pattern(i // per, i % per), total * es)
    if op == "reduce_scatter":
        inp = _fill(mk(total, 0), lambda i: pattern(rank, i))
        out = mk(per, -1)
        table = sum_table(n).to(device)
        expected = lambda i: table[(rank * per + i) % PATTERN_MOD]  # noqa: E731
        if fallback_rs:
            def call() -> None:
                tmp = inp.clone()
                dist.all_reduce(tmp, group=group)
                out.copy_(tmp[rank * per:(rank + 1) * per])
            return Case(op, call, out, expected, total * es, impl="all_reduce+slice")
        scatter = native_collective("reduce_scatter_single", "reduce_scatter_tensor")
        return Case(op, lambda: scatter(out, inp, group=group), out, expected, total * es)
    if op == "all_to_all":
        inp = _fill(mk(total, 0), lambda i: pattern(rank, i))
        out = mk(total, -1)
        return Case(op, lambda: dist.all_to_all_single(out, inp, group=group), out,
                    lambda i: pattern(i // per, rank * per + i % per), total * es)
    raise UserError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def _sync(device: torch.device) -> None:
    # Collectives on an accelerator are asynchronous: time only what has finished.
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure(case: Case, device: torch.device, tol: float, iters: int, warmup: int,
            group: Any) -> tuple[float, int]:
    """Check one result of ``case``, then time it: ``(seconds per call, wrong elements)``.

    Every rank of ``group`` must call this at the same point. The timed loop is the bare call
    in a Python loop, one device sync at the end: the same work a hand-written loop does.
    """
    case.call()
    _sync(device)
    wrong = case.check(tol)
    case.reset()
    for _ in range(warmup):
        case.call()
    _sync(device)
    dist.barrier(group=group)
    call = case.call
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    return (time.perf_counter() - start) / max(1, iters), wrong

