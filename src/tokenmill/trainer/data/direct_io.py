"""Many small reads from local files at the disk's random-read limit: Linux native AIO with O_DIRECT.

Uniform sampling reads one window (8 KB at 4,096 tokens of uint16) from a random place of the shards per
sequence. Through the page cache (memory maps, `posix_fadvise`) every read costs a system call and page
cache work on the thread that asks, and a disk that answers 100K random reads a second is left waiting
on the CPU. Here a batch's reads are handed to the kernel in one `io_submit` each, up to `queue_depth` in
flight, straight into the caller's buffers (O_DIRECT: no page cache, no copy), and one thread collects
their completions (`io_getevents`) at a fifth of a core. The system calls are made through ctypes: the
interface is four syscalls and two fixed structs, and the libaio C library is not needed.

O_DIRECT wants file offsets, lengths and buffer addresses aligned to the device's block size: `align`
is probed on the first file (512 bytes, else 4,096) and `aligned_buffer` gives page-aligned memory.
Linux on x86-64 and arm64 only. `DirectIOUnavailable` says why it cannot be used (another system, a
seccomp profile without io_setup, a filesystem that refuses O_DIRECT such as some FUSE filesystems or
tmpfs before Linux 6.6); the caller falls back to memory maps.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import queue
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 512
PAGE = 4096
# Completions are waited for in slices of this long, so that newly submitted reads start soon after.
_POLL_NS = 2_000_000
# io_setup, io_destroy, io_getevents, io_submit
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2), "arm64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0
# struct iocb and struct io_event of <linux/aio_abi.h>, little-endian layout.
_IOCB = np.dtype(
    [
        ("data", "<u8"),
        ("key", "<u4"),
        ("rw_flags", "<i4"),
        ("opcode", "<u2"),
        ("reqprio", "<i2"),
        ("fildes", "<u4"),
        ("buf", "<u8"),
        ("nbytes", "<u8"),
        ("offset", "<i8"),
        ("reserved2", "<u8"),
        ("flags", "<u4"),
        ("resfd", "<u4"),
    ]
)
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
_INDEX_BITS = 32


class DirectIOUnavailable(OSError):
    """Native AIO with O_DIRECT cannot be used here (the message says why)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def aligned_buffer(size: int, alignment: int = PAGE) -> np.ndarray:
    """`size` bytes (uint8) starting at a multiple of `alignment` (O_DIRECT reads into it)."""
    raw = np.empty(size + alignment, dtype=np.uint8)
    skip = -raw.ctypes.data % alignment
    return raw[skip : skip + size]


def _syscalls() -> tuple[ctypes.CDLL, tuple[int, int, int, int]]:
    machine = platform.machine().lower()
    if not sys.platform.startswith("linux") or machine not in _SYSCALLS or sys.byteorder != "little":
        raise DirectIOUnavailable(f"native AIO is implemented for Linux on x86-64 and arm64, not {machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc, _SYSCALLS[machine]


class _Request:
    """One `submit`: its iocbs and buffer (kept alive while the kernel holds pointers to them), its future.

    `paths[path_index[i]]` is read i's file, looked up only to name it in an error.
    """

    def __init__(
        self,
        number: int,
        iocbs: np.ndarray,
        buffer: np.ndarray,
        needed: np.ndarray,
        paths: Sequence[str],
        path_index: np.ndarray,
    ) -> None:
        self.number = number
        self.iocbs = iocbs
        self.pointers = iocbs.ctypes.data + np.arange(len(iocbs), dtype=np.uint64) * _IOCB.itemsize
        self.buffer = buffer
        self.needed = needed
        self.paths = paths
        self.path_index = path_index
        self.submitted = 0
        self.remaining = len(iocbs)
        self.error: BaseException | None = None
        self.future: Future[None] = Future()


class DirectReader:
    """Reads byte ranges of files into caller-given buffers with O_DIRECT, `queue_depth` reads in flight.

    `submit(paths, offsets, sizes, buffer, buffer_offsets, needed)` returns a Future that is done when
    every read has landed in `buffer`; it fails with OSError naming the file and offset when a read fails
    or returns fewer than `needed` bytes (a truncated file). With `thread=True` (default) a helper thread
    submits and collects, and `submit` returns at once; with `thread=False` `submit` does the reads on the
    caller's thread and returns a finished Future. Offsets and sizes must be multiples of `align`, and
    the buffer positions multiples of PAGE.
    """

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, thread: bool = True) -> None:
        self._libc, (self._setup, self._destroy, self._getevents, self._submit) = _syscalls()
        self.queue_depth = int(queue_depth)
        self._context = ctypes.c_ulong(0)
        if self._libc.syscall(self._setup, ctypes.c_long(self.queue_depth), ctypes.byref(self._context)) != 0:
            code = ctypes.get_errno()
            hint = " (the system's fs.aio-max-nr is reached)" if code == errno.EAGAIN else ""
            raise DirectIOUnavailable(code, f"io_setup refused: {os.strerror(code)}{hint}")
        self.align = 0
        self._fds: dict[str, int] = {}
        self._events = np.zeros(self.queue_depth, dtype=_EVENT)
        self._requests: dict[int, _Request] = {}
        self._waiting: list[_Request] = []  # submitted by the caller, not all handed to the kernel yet
        self._inflight = 0
        self._numbers = 0
        self._closed = False
        self._broken: BaseException | None = None
        self._lock = threading.Lock()
        self._incoming: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._serve, name="tokenmill-direct-reads", daemon=True)
            self._thread.start()

    def open(self, path: str) -> int:
        """The O_DIRECT descriptor of `path` (opened once); the first file also sets `align`."""
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError as error:
            if error.errno == errno.EINVAL:
                raise DirectIOUnavailable(errno.EINVAL, f"{path}: its filesystem refuses O_DIRECT") from error
            raise
        if not self.align:
            self.align = _probe_alignment(fd, path)
        self._fds[path] = fd
        return fd

    def submit(
        self,
        paths: Sequence[str],
        path_index: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        buffer: np.ndarray,
        buffer_offsets: np.ndarray,
        needed: np.ndarray,
    ) -> Future[None]:
        """Read sizes[i] bytes of paths[path_index[i]] at offsets[i] into buffer[buffer_offsets[i]:]."""
        if self._closed:
            raise RuntimeError("the reader is closed")
        if self._broken is not None:
            raise RuntimeError(f"the reader's thread failed: {self._broken}") from self._broken
        count = len(offsets)
        if buffer_offsets.size and int((buffer_offsets + sizes).max()) > buffer.nbytes:
            raise ValueError("the reads do not fit in the buffer")
        # Only the files these reads touch: `paths` can list every shard of a large dataset.
        used, which = np.unique(path_index, return_inverse=True)
        fds = np.array([self.open(paths[i]) for i in used.tolist()], dtype=np.uint32)
        iocbs = np.zeros(count, dtype=_IOCB)
        iocbs["opcode"] = _IOCB_CMD_PREAD
        iocbs["fildes"] = fds[which]
        iocbs["buf"] = np.uint64(buffer.ctypes.data) + buffer_offsets.astype(np.uint64)
        iocbs["nbytes"] = sizes
        iocbs["offset"] = offsets
        with self._lock:
            self._numbers += 1
            number = self._numbers
        iocbs["data"] = (np.uint64(number) << np.uint64(_INDEX_BITS)) | np.arange(count, dtype=np.uint64)
        request = _Request(number, iocbs, buffer, np.asarray(needed, dtype=np.int64), paths, path_index)
        if count == 0:
            request.future.set_result(None)
        elif self._thread is not None:
            self._incoming.put(request)
        else:
            self._accept(request)
            while not request.future.done():
                self._pump(wait=True)
        return request.future

    def close(self) -> None:
        """Wait for the reads in flight, fail those not started, free the kernel context and descriptors."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._incoming.put(None)
            self._thread.join()
            while True:  # submitted after the thread's last look
                try:
                    request = self._incoming.get_nowait()
                except queue.Empty:
                    break
                if request is not None:
                    self._accept(request)
        while self._inflight:
            self._reap(wait=True)
        for request in self._waiting:
            request.remaining -= len(request.iocbs) - request.submitted
            self._fail(request, RuntimeError("the reader was closed before this read started"))
            self._finish_if_done(request)
        self._waiting.clear()
        self._libc.syscall(self._destroy, self._context)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules may be gone
            pass

    # --- the loop: hand reads to the kernel, collect what completes -------------------------------------

    def _serve(self) -> None:
        try:
            while True:
                idle = not self._inflight and not self._waiting
                try:
                    request = self._incoming.get(block=idle)
                except queue.Empty:
                    request = None
                else:
                    if request is None:
                        return
                while request is not None:  # take everything queued, in order
                    self._accept(request)
                    try:
                        request = self._incoming.get_nowait()
                    except queue.Empty:
                        break
                    if request is None:
                        return  # close() finishes what is in flight
                self._pump(wait=True, timeout_ns=_POLL_NS)
        except BaseException as error:  # a broken reader must not leave callers waiting forever
            self._broken = error
            for request in list(self._requests.values()):
                if not request.future.done():
                    request.future.set_exception(error)

    def _accept(self, request: _Request) -> None:
        self._requests[request.number] = request
        self._waiting.append(request)

    def _pump(self, wait: bool, timeout_ns: int | None = None) -> None:
        """Hand the kernel what fits in the queue, then collect completions."""
        self._submit_waiting()
        if self._inflight:
            self._reap(wait, timeout_ns)

    def _submit_waiting(self) -> None:
        while self._waiting and self._inflight < self.queue_depth:
            request = self._waiting[0]
            count = min(self.queue_depth - self._inflight, len(request.iocbs) - request.submitted)
            pointers = request.pointers[request.submitted :]
            taken = self._libc.syscall(
                self._submit, self._context, ctypes.c_long(count), ctypes.c_void_p(int(pointers.ctypes.data))
            )
            if taken < 0:
                code = ctypes.get_errno()
                if code == errno.EAGAIN:
                    return  # the kernel's queue is full: retry after some complete
                self._waiting.pop(0)
                self._fail(request, OSError(code, f"io_submit: {os.strerror(code)}"))
                request.remaining -= len(request.iocbs) - request.submitted
                self._finish_if_done(request)
                continue
            request.submitted += taken
            self._inflight += taken
            if request.submitted == len(request.iocbs):
                self._waiting.pop(0)

    def _reap(self, wait: bool, timeout_ns: int | None = None) -> None:
        """Collect completed reads: at least one when `wait` (or until the timeout)."""
        timeout = None
        if timeout_ns is not None:
            timeout = ctypes.byref(_Timespec(timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000))
        got = self._libc.syscall(
            self._getevents,
            self._context,
            ctypes.c_long(1 if wait else 0),
            ctypes.c_long(self.queue_depth),
            ctypes.c_void_p(self._events.ctypes.data),
            timeout,
        )
        if got < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                return
            raise OSError(code, f"io_getevents: {os.strerror(code)}")
        if got:
            self._complete(self._events[:got].copy())

    def _complete(self, events: np.ndarray) -> None:
        self._inflight -= len(events)
        numbers = events["data"] >> np.uint64(_INDEX_BITS)
        indices = (events["data"] & np.uint64((1 << _INDEX_BITS) - 1)).astype(np.int64)
        for number in np.unique(numbers).tolist():
            request = self._requests[number]
            mine = numbers == number
            results, where = events["res"][mine], indices[mine]
            short = np.flatnonzero(results < request.needed[where])
            if short.size and request.error is None:
                i, result = int(where[short[0]]), int(results[short[0]])
                iocb = request.iocbs[i]
                at = f"{request.paths[request.path_index[i]]} at byte {int(iocb['offset'])}"
                if result < 0:
                    self._fail(request, OSError(-result, f"{at}: {os.strerror(-result)}"))
                else:
                    message = f"{at}: read {result} of {int(request.needed[i])} bytes (a truncated shard?)"
                    self._fail(request, OSError(errno.EIO, message))
            request.remaining -= int(mine.sum())
            self._finish_if_done(request)

    def _fail(self, request: _Request, error: BaseException) -> None:
        if request.error is None:
            request.error = error

    def _finish_if_done(self, request: _Request) -> None:
        if request.remaining:
            return
        del self._requests[request.number]
        if request.error is not None:
            request.future.set_exception(request.error)
        else:
            request.future.set_result(None)


def _probe_alignment(fd: int, path: str) -> int:
    """The smallest of 512 and 4,096 bytes that O_DIRECT reads of this file accept."""
    buffer = aligned_buffer(PAGE)
    size = os.fstat(fd).st_size
    for align in (512, PAGE):
        if size < 2 * align:
            return PAGE  # too small to tell: the safe choice
        try:
            os.preadv(fd, [memoryview(buffer)[:align]], align)
            return align
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
    raise DirectIOUnavailable(errno.EINVAL, f"{path}: no O_DIRECT alignment of 512 or 4096 bytes works")
