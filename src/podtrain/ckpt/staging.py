"""One save's tensor bytes, streamed from the step loop to the background writer through the pool.

A safetensors file's data section is the concatenation of its tensors' bytes, so a save is a byte
stream per file. ``SaveStream.produce`` (the step loop, inside ``Checkpointer.save``) copies the
live tensors' bytes, in file order, into slabs of the ``StagingPool`` and queues each full slab;
``SaveStream.chunks`` (the writer thread) yields them for writing and hashing and returns each slab
to the pool afterwards. When everything this rank writes fits the budget, ``produce`` never waits
and the step loop pays only for the copies (as before); when it does not, ``produce`` waits for
the writer to free slabs, so the step loop also pays for writing all but the last budget's worth.
Host memory stays within the budget either way.

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
from typing import Iterator

import torch

from podtrain.ckpt.host_buffers import StagingPool, byte_array, flat_bytes
from podtrain.ckpt.tensorio import spec_of

_END = object()  # queued after a file's last slab


class StagingAborted(RuntimeError):
    """The other side of a ``SaveStream`` failed or gave up."""


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
    """The tensors of one save, by output file, flowing through ``pool`` (see the module docstring)."""

    def __init__(self, pool: StagingPool, files: dict[str, list[tuple[str, torch.Tensor]]]) -> None:
        """``files``: for each output file (a key the writer asks for), its ``(name, live tensor)``s."""
        self.pool = pool
        self.specs = {f: [spec_of(n, t) for n, t in items]
                      for f, items in files.items()}
        self._sources = files
        self._queues: dict[str, collections.deque] = {f: collections.deque() for f in files}
        self._cond = threading.Condition()
        self._failure: str | None = None
        self._held: torch.Tensor | None = None  # the slab the writer is reading now
        self.staged_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this stream carries (all files)."""
        return sum(s.nbytes for specs in self.specs.values() for s in specs)

    # -- producer: the step loop ---------------------------------------------------------------
    def produce(self, device: torch.device, fence: CopyFence | None = None) -> None:
        """Copy every tensor's bytes into slabs and queue them, file by file (blocks on a full pool),
        on ``fence``'s side stream on a GPU.

        Returns early (quietly) when the writer gave up: its error reaches the step loop through
        the job. Raises, and fails the stream for the writer, when a copy itself fails.
        """
        try:
            with fence.copying() if fence is not None else contextlib.nullcontext():
                for file, items in self._sources.items():
                    if not self._produce_file(file, items, device):
                        return
        except BaseException as exc:
            self.fail(f"staging on the step loop failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._sources = {}  # no references to live tensors once staged

    def _produce_file(self, file: str, items: list[tuple[str, torch.Tensor]], device: torch.device) -> bool:
        cuda = device.type == "cuda"
        slab, fill, cpu_pieces, gpu_copies = None, 0, [], False
        size = self.pool.slab_bytes
        for _, tensor in items:
            src = flat_bytes(tensor)
            pos, n = 0, src.numel()
            while pos < n:
                if slab is None:
                    slab = self.pool.acquire(lambda: self._failure is not None)
                    if slab is None:
                        return False
                    fill = 0
                k = min(n - pos, size - fill)
                if src.device.type == "cpu":
                    cpu_pieces.append((byte_array(slab[fill:fill + k]), byte_array(src[pos:pos + k])))
                else:
                    slab[fill:fill + k].copy_(src[pos:pos + k], non_blocking=True)
                    gpu_copies = True
                fill += k
                pos += k
                if fill == size:
                    self._flush(file, slab, fill, cpu_pieces, gpu_copies and cuda)
                    slab, cpu_pieces, gpu_copies = None, [], False
        if slab is not None:
            self._flush(file, slab, fill, cpu_pieces, gpu_copies and cuda)
        self._put(file, _END)
        return True

    def _flush(self, file: str, slab: torch.Tensor, fill: int, cpu_pieces: list, gpu: bool) -> None:
        self.pool.copy_cpu(cpu_pieces)
        event = None
        if gpu:
            event = torch.cuda.Event()
            event.record()  # on the current stream, after this slab's copies
        self.staged_bytes += fill
        self._put(file, (slab, fill, event))

    def _put(self, file: str, item: object) -> None:
        with self._cond:
            if self._failure is not None:
                if item is not _END:
                    self.pool.release(item[0])
                return
            self._queues[file].append(item)
            self._cond.notify_all()

    # -- consumer: the writer thread -----------------------------------------------------------
    def chunks(self, file: str) -> Iterator[memoryview]:
        """The bytes of ``file``'s tensors, slab by slab, in order; each slab is released after use."""
        while True:
            with self._cond:
                while not self._queues[file] and self._failure is None:
                    self._cond.wait(1.0)
                if self._failure is not None:
                    raise StagingAborted(self._failure)
                item = self._queues[file].popleft()
            if item is _END:
                return
            slab, fill, event = item
            with self._cond:
                self._held = slab
            try:
                if event is not None:
                    event.synchronize()  # the DMA into this slab is complete
                yield memoryview(byte_array(slab[:fill])).cast("B")
            finally:
                self._release_held(slab)

    def _release_held(self, slab: torch.Tensor) -> None:
        with self._cond:
            if self._held is slab:
                self._held = None
                self.pool.release(slab)

    def close(self, reason: str) -> None:
        """The writer is done with this stream (whatever happened): ``fail`` it, and return the
        slab it was reading, even when a failed write left the ``chunks`` iterator suspended."""
        self.fail(reason)
        with self._cond:
            if self._held is not None:
                self._release_held(self._held)

    def fail(self, reason: str) -> None:
        """Stop both sides: queued slabs go back to the pool, waiters wake up (idempotent)."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            for queue in self._queues.values():
                while queue:
                    item = queue.popleft()
                    if item is not _END:
                        self.pool.release(item[0])
            self._cond.notify_all()
        self.pool.wake()
