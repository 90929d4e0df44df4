"""One save's tensor bytes, streamed from the step loop to the background writer through the pool.

A safetensors file's data section is the concatenation of its tensors' bytes, so a save is a byte
stream per file. ``SaveStream.produce`` (the step loop, inside ``Checkpointer.save``) copies the
live tensors' bytes, in file order, into slabs of the ``StagingPool`` and queues each full slab;
``SaveStream.chunks`` (the writer thread) yields them for writing and hashing and returns each slab
to the pool afterwards. When everything this rank writes fits the budget, ``produce`` never waits
and the step loop pays only for the copies (as before); when it does not, ``produce`` waits for
the writer to free slabs, so the step loop also pays for writing all but the last budget's worth.
Host memory stays within the budget either way.

A failed write is sent again (``Store.write_replayable``: on S3 a part that failed all of the
client's attempts aborts the multipart upload, and the rank's file is uploaded again from its first
byte, since S3 keeps nothing of an unfinished upload that could be read back). Its bytes come again
from the same budget, never from a second copy; the rule (``SaveStream.replay``):

- the rank's share fits the pool (``KEEP``; the default budget makes this the common case): the
  writer keeps the slabs it has written until the file is committed (``done_with``), and a
  replay reads them again. Nothing is copied twice and the step loop is not held: it was never
  going to reuse those slabs before the next save;
- it does not (``RESTAGE``): slabs must be reused while the file is written, so what a replay needs
  is gone from host memory, but not from the live tensors as long as the step loop stays in
  ``produce`` (it is waiting for slabs anyway: all but the last budget's worth is written while
  it waits). So after staging the file the step loop stays, up to ``hold_s`` (``REPLAY_HOLD_S``),
  until the writer has committed it, and stages it again from the live tensors when a write fails.
  This costs the stall the write of the last budget's worth on the happy path; a failure after
  ``hold_s`` (counted once, from the first pass; never past a stop's deadline) cannot be replayed
  (``NotReplayable``) and abandons the save as before;
- ``ONCE`` (``REPLAY`` off, for benches): each file is written once; a failed write abandons the save.

On a GPU the copies are asynchronous DMA into pinned slabs, issued on a side stream
(``CopyFence``) that first waits for the current stream (so they follow the optimizer step that
produced the values); the next step's forward and backward, which only read the weights, overlap
them, and only the next optimizer step (the first writer of the copied tensors) waits on their
event, through an optimizer step pre-hook. That wait is timed with CUDA events, so the stall the
loop reports is the device's, not the host's enqueue time. An event recorded after each slab's
copies is synchronized by the writer before it reads the slab. On the CPU the same code runs with
no stream and no events: the copies are synchronous, and the host time is the stall.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Iterator

import torch

from podtrain.ckpt.host_buffers import StagingPool, byte_array, flat_bytes
from podtrain.ckpt.tensorio import spec_of
from podtrain.storage.retry import Deadline

_END = object()  # queued after a file's last slab
# How a stream lets the writer read a file again after a failed write (``SaveStream.replay``).
KEEP, RESTAGE, ONCE = "keep", "restage", "once"
# What became of one staging pass of a file (``SaveStream.produce``).
_STAGED, _AGAIN, _DONE, _FAILED = "staged", "again", "done", "failed"

REPLAY = True
"""Whether new streams let a failed write be sent again (the default of ``SaveStream(replay=)``,
read when a stream is made; ``bench/s3_save_faults.py`` turns it off to measure saves without it)."""
REPLAY_HOLD_S = 10.0
"""How long the step loop, having staged a file larger than the pool, stays ready to stage it again
for a failed write (the default of ``SaveStream(hold_s=)``; as ``ckpt.save_wait_s``, 10 s): one
bound from the end of the file's first staging pass, however many passes follow."""
STALL_S = 300.0
"""How long the step loop waits for the writer to free a slab before giving the save up
(``StagingTimedOut``: the storage accepts nothing, a request that never answers): the step loop
goes on, and the save is abandoned like one whose storage retries were spent."""


class StagingAborted(RuntimeError):
    """The other side of a ``SaveStream`` failed or gave up."""


class StagingTimedOut(StagingAborted):
    """The step loop stopped staging at its deadline (``STALL_S`` without a free slab, or a stop's
    grace period): the storage is not taking the bytes. A transient fault for the writer."""


class NotReplayable(RuntimeError):
    """A file's bytes were asked for again after a failed write, but the stream no longer has them
    (its share exceeds the pool and the step loop stopped holding it: see the module docstring)."""


class CopyFence:
    """The side stream of a save's device-to-host copies and the next optimizer step's wait on them.

    One per checkpointer (the stream is reused). On the CPU every method is a no-op and
    ``wait_s`` is 0: the same code path, with the host clock as the truth.
    """

    def __init__(self, device: torch.device) -> None:
        """``device``: the rank's compute device."""
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._done = None
        self._timing: tuple | None = None  # (before, after) events around the optimizer's wait
        self._hook = None

    @contextlib.contextmanager
    def copying(self):
        """Run the copies issued inside on the side stream, after the current stream's work."""
        if not self.cuda:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield
        self._done = torch.cuda.Event()
        self._done.record(self._stream)

    def hold_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer``'s next step wait (on the device) for the copies, and time that wait."""
        if not self.cuda or self._done is None:
            return
        self.release()
        done = self._done

        def wait_for_copies(_opt, _args, _kwargs):
            self.release()
            main = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(main)
            main.wait_event(done)
            after.record(main)
            self._timing = (before, after)

        self._hook = optimizer.register_step_pre_hook(wait_for_copies)

    def release(self) -> None:
        """Remove the optimizer hook (its step ran, or the run ends)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def wait_s(self) -> float:
        """Seconds the optimizer step waited for the copies, once known (never blocks; else 0)."""
        if self._timing is None:
            return 0.0
        before, after = self._timing
        if not after.query():
            return 0.0
        self._timing = None
        return before.elapsed_time(after) / 1000.0


class SaveStream:
    """The tensors of one save, by output file, flowing through ``pool``; ``replay`` (``KEEP``,
    ``RESTAGE`` or ``ONCE``) says how the writer may read a file again after a failed write (the
    module docstring says which and why).

    Every wait of the step loop here has a deadline: a free slab, ``STALL_S`` each; the hold,
    ``hold_s`` in all; and both at most ``deadline`` (a stop's: ``ckpt.grace_s``), after which
    the stream is given up (``StagingTimedOut`` for the writer) and the step loop goes on.
    """

    def __init__(self, pool: StagingPool, files: dict[str, list[tuple[str, torch.Tensor]]],
                 replay: bool | None = None, hold_s: float | None = None, deadline: Deadline | None = None) -> None:
        """``files``: for each output file (a key the writer asks for), its ``(name, live tensor)``s;
        ``replay``: let a failed write read a file again (None: ``REPLAY``); ``hold_s``: how long
        the step loop stays ready to stage a file again when it does not fit the pool (None:
        ``REPLAY_HOLD_S``); ``deadline``: a stop's, which bounds every wait of the step loop."""
        self.pool = pool
        self.specs = {f: [spec_of(n, t) for n, t in items]
                      for f, items in files.items()}
        self._sources = files
        self._queues: dict[str, collections.deque] = {f: collections.deque() for f in files}
        self._kept: dict[str, list] = {f: [] for f in files}  # KEEP: what the writer read, in order
        self._pass = dict.fromkeys(files, 0)  # RESTAGE: the staging pass the writer reads now
        self._reads = dict.fromkeys(files, 0)  # how many times the writer began reading each file
        self._finished: set[str] = set()  # files the writer is done with (written, or given up)
        self._let_go: set[str] = set()  # RESTAGE: files the step loop no longer holds
        self._hold_until: dict[str, float] = {}  # RESTAGE: when the hold of each file ends (all passes)
        self.deadline = deadline
        self._timed_out = False  # the step loop gave the stream up at a deadline (StagingTimedOut)
        self.taken_bytes = 0
        """Bytes the writer took beyond any earlier read's furthest point: the storage's progress
        on this stream (a read that starts over after a failure adds only once past it)."""
        self.taken_at = 0.0
        """When (monotonic) ``taken_bytes`` last grew (0: never)."""
        self._furthest: dict[str, int] = dict.fromkeys(files, 0)
        self._cond = threading.Condition()
        self._failure: str | None = None
        self._held: tuple[torch.Tensor, int] | None = None  # the slab the writer reads now, and which read
        self.staged_bytes = 0
        """Bytes copied into slabs so far (a file staged again counts again)."""
        self.hold_s = REPLAY_HOLD_S if hold_s is None else hold_s
        slabs = sum(-(-sum(s.nbytes for s in specs) // pool.slab_bytes) for specs in self.specs.values())
        self.slabs = slabs
        """Slabs one staging pass of every file takes."""
        self.replay = ONCE if not (REPLAY if replay is None else replay) else \
            KEEP if slabs <= pool.max_slabs else RESTAGE

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this stream carries (all files)."""
        return sum(s.nbytes for specs in self.specs.values() for s in specs)

    def fits_free(self) -> bool:
        """Whether one staging pass takes no more slabs than the pool can hand out now: the step
        loop then stages everything without waiting for the writer to give a slab back, so the
        writer may start after it (``Checkpointer.save``: its start, storage requests in Python,
        would otherwise contend with the copies for the GIL)."""
        return self.slabs <= self.pool.available_slabs()

    @property
    def replayable(self) -> bool:
        """Whether a failed write of a file can be sent again (``replay`` is not ``ONCE``)."""
        return self.replay != ONCE

    # -- producer: the step loop ---------------------------------------------------------------
    def produce(self, device: torch.device, fence: CopyFence | None = None) -> None:
        """Copy every tensor's bytes into slabs and queue them, file by file (blocks on a full pool),
        on ``fence``'s side stream on a GPU; with ``RESTAGE``, stay after each file, staging it
        again when its write fails, until it is written or ``hold_s`` has passed.

        Returns early (quietly) when the writer gave up: its error reaches the step loop through
        the job. Raises, and fails the stream for the writer, when a copy itself fails.
        """
        try:
            with fence.copying() if fence is not None else contextlib.nullcontext():
                for file, items in self._sources.items():
                    while True:
                        number = self._pass[file]
                        state = self._produce_file(file, items, device, number)
                        if state == _STAGED and self.replay == RESTAGE:
                            state = self._hold(file, number)
                        if state == _FAILED:
                            return
                        if state != _AGAIN:  # staged, or the writer is done with the file
                            break
        except BaseException as exc:
            self.fail(f"staging on the step loop failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._sources = {}  # no references to live tensors once staged

    def _state(self, file: str, number: int) -> str | None:
        """Why staging pass ``number`` of ``file`` must stop (None: it goes on). Reads without the
        lock (each read is atomic): ``pool.acquire`` asks it while holding the pool's lock."""
        if self._failure is not None:
            return _FAILED
        if file in self._finished:
            return _DONE
        return _AGAIN if self._pass[file] != number else None

    def _produce_file(self, file: str, items: list[tuple[str, torch.Tensor]], device: torch.device,
                      number: int) -> str:
        cuda = device.type == "cuda"
        slab, fill, cpu_pieces, gpu_copies = None, 0, [], False
        slab_np = None  # the slab's bytes as numpy (CPU sources): sliced per piece, no torch op per piece
        size = self.pool.slab_bytes
        for _, tensor in items:
            src = flat_bytes(tensor)
            on_cpu = src.device.type == "cpu"
            src_np = byte_array(src) if on_cpu else None
            pos, n = 0, src.numel()
            while pos < n:
                if slab is None:
                    slab = self._acquire(file, number)
                    if slab is None:
                        return self._state(file, number)
                    fill, slab_np = 0, None
                k = min(n - pos, size - fill)
                if on_cpu:
                    if slab_np is None:
                        slab_np = byte_array(slab)
                    cpu_pieces.append((slab_np[fill:fill + k], src_np[pos:pos + k]))
                else:
                    slab[fill:fill + k].copy_(src[pos:pos + k], non_blocking=True)
                    gpu_copies = True
                fill += k
                pos += k
                if fill == size:
                    if not self._flush(file, number, slab, fill, cpu_pieces, gpu_copies and cuda):
                        return self._state(file, number)
                    slab, cpu_pieces, gpu_copies = None, [], False
        if slab is not None and not self._flush(file, number, slab, fill, cpu_pieces, gpu_copies and cuda):
            return self._state(file, number)
        return _STAGED if self._put(file, number, _END) else self._state(file, number)

    def _acquire(self, file: str, number: int) -> torch.Tensor | None:
        """A free slab for pass ``number`` of ``file``, waiting ``STALL_S`` at most (and never past
        ``deadline``); None when the pass ended meanwhile, or when that time passed: then the
        stream is given up (the writer sees ``StagingTimedOut``) and ``_state`` says ``_FAILED``."""
        limit = STALL_S if self.deadline is None else min(STALL_S, self.deadline.remaining())
        until = time.monotonic() + limit
        # (the pool re-checks this on every wake-up and at least once a second)
        slab = self.pool.acquire(lambda: self._state(file, number) is not None or time.monotonic() >= until)
        if slab is None and self._state(file, number) is None:
            self._give_up(f"the writer took no staged bytes for {limit:.1f} s (the storage is not answering"
                          f"{'' if self.deadline is None or limit == STALL_S else ', and the stop deadline came'})")
        return slab

    def _give_up(self, reason: str) -> None:
        """The step loop stops staging at a deadline: the writer sees ``StagingTimedOut``."""
        self._timed_out = True
        self.fail(f"staging stopped: {reason}")

    def _flush(self, file: str, number: int, slab: torch.Tensor, fill: int, cpu_pieces: list, gpu: bool) -> bool:
        self.pool.copy_cpu(cpu_pieces)
        event = None
        if gpu:
            event = torch.cuda.Event()
            event.record()  # on the current stream, after this slab's copies
        self.staged_bytes += fill
        return self._put(file, number, (slab, fill, event))

    def _put(self, file: str, number: int, item: object) -> bool:
        """Queue ``item`` of pass ``number``; False (its slab back in the pool) when that pass ended."""
        with self._cond:
            if self._state(file, number) is not None:
                if item is not _END:
                    self.pool.release(item[0])
                return False
            self._queues[file].append(item)
            self._cond.notify_all()
            return True

    def _hold(self, file: str, number: int) -> str:
        """After a whole pass of a file larger than the pool: wait until the writer is done with it
        (``_DONE``), asks for it again (``_AGAIN``), fails (``_FAILED``), or the hold ends (then
        the file can no longer be sent again: ``_STAGED``). The live tensors do not change meanwhile:
        the step loop is here. The hold ends ``hold_s`` after the file's first pass was staged,
        whatever passes followed (a storage failing every try must not hold the loop per try), and
        at the stop's ``deadline`` at the latest."""
        deadline = self._hold_until.setdefault(file, time.monotonic() + self.hold_s)
        if self.deadline is not None:
            deadline = min(deadline, self.deadline.at)
        with self._cond:
            while (state := self._state(file, number)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._let_go.add(file)
                    return _STAGED
                self._cond.wait(min(left, 1.0))
            return state

    # -- consumer: the writer thread -----------------------------------------------------------
    def chunks(self, file: str) -> Iterator[memoryview]:
        """The bytes of ``file``'s tensors, slab by slab, in order, from the start: a later call
        (the file's write failed and is sent again) starts over, from the kept slabs (``KEEP``) or
        from a new staging pass (``RESTAGE``). Raises ``NotReplayable`` for a later call when the
        stream no longer has the bytes (``ONCE``, or ``RESTAGE`` after the step loop let go)."""
        with self._cond:
            self._reads[file] += 1
            if self._reads[file] > 1:
                self._rewind(file)
            read = self._reads[file]
        return self._read(file, read)

    def _rewind(self, file: str) -> None:
        """(Under the lock.) Make the next read of ``file`` start over, or raise why it cannot."""
        if self._failure is not None:
            raise (StagingTimedOut if self._timed_out else StagingAborted)(self._failure)
        if self.replay == KEEP:
            return  # the kept slabs are read again, then the rest as it arrives
        if self.replay == ONCE or file in self._let_go or file in self._finished:
            raise NotReplayable(f"{file} cannot be sent again: " + (
                "replaying failed writes is turned off" if self.replay == ONCE else
                f"its {sum(s.nbytes for s in self.specs[file])} bytes exceed the staging pool "
                f"({self.pool.budget_bytes} bytes, ckpt.host_staging_mb) and the step loop stopped "
                f"holding them {self.hold_s:g} s after staging them"))
        self._release_held()  # the failed read's slab and the rest of its pass: a new pass follows
        self._drain(self._queues[file])
        self._pass[file] += 1
        self._cond.notify_all()
        self.pool.wake()  # a step loop waiting in acquire for this pass's slabs starts the next one

    def _read(self, file: str, read: int) -> Iterator[memoryview]:
        kept = self._kept[file]
        i, position = 0, 0
        while True:
            with self._cond:
                while i >= len(kept) and not self._queues[file] and self._failure is None:
                    self._cond.wait(1.0)
                if self._failure is not None:
                    raise (StagingTimedOut if self._timed_out else StagingAborted)(self._failure)
                if i < len(kept):  # KEEP, read again
                    item = kept[i]
                else:
                    item = self._queues[file].popleft()
                    if self.replay == KEEP:
                        kept.append(item)
                    elif item is not _END:
                        self._held = (item[0], read)
                i += 1
            if item is _END:
                return
            slab, fill, event = item
            position += fill
            if position > self._furthest[file]:  # bytes no earlier read reached: progress
                self.taken_bytes += position - self._furthest[file]
                self.taken_at = time.monotonic()
                self._furthest[file] = position
            try:
                if event is not None:
                    event.synchronize()  # the DMA into this slab is complete
                yield memoryview(byte_array(slab[:fill])).cast("B")
            finally:
                if self.replay != KEEP:
                    with self._cond:
                        # only this read's slab: an abandoned read's generator, finalised late,
                        # must not release a slab (the same tensor, reused) that a later read holds
                        if self._held is not None and self._held[0] is slab and self._held[1] == read:
                            self._release_held()

    def _release_held(self) -> None:
        """(Under the lock.) Give back the slab the writer was reading, if any."""
        if self._held is not None:
            self.pool.release(self._held[0])
            self._held = None

    def _drain(self, items) -> None:
        """(Under the lock.) Give back the slabs of ``items`` (a queue or a kept list), emptying it."""
        for item in items:
            if item is not _END:
                self.pool.release(item[0])
        items.clear()

    def done_with(self, file: str) -> None:
        """The writer has written ``file``, or gave up on it: its slabs go back to the pool, and a
        step loop still staging it, or holding it for a replay, goes on (idempotent)."""
        with self._cond:
            self._finished.add(file)
            self._release_held()
            self._drain(self._kept[file])
            self._drain(self._queues[file])
            self._cond.notify_all()
        self.pool.wake()

    def close(self, reason: str) -> None:
        """The writer is done with this stream (whatever happened): ``fail`` it, and return every
        slab it holds (kept ones, and the one a failed write left a ``chunks`` iterator suspended on)."""
        self.fail(reason)
        with self._cond:
            self._release_held()
            for kept in self._kept.values():
                self._drain(kept)

    def fail(self, reason: str) -> None:
        """Stop both sides: queued slabs go back to the pool, waiters wake up (idempotent)."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            for queue in self._queues.values():
                self._drain(queue)
            self._cond.notify_all()
        self.pool.wake()
