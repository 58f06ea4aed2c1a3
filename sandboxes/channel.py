"""Moving bytes between the host and a sandboxed process under a deadline, with bounded memory.

Contract:

* :func:`pump` writes ``payload`` to the process's stdin and reads stdout/stderr into two :class:`Sink` objects
  until the sinks have seen their end-of-cell markers (``stop_on_markers``), or both streams reach end of file or
  the process exits (``proc.exit_fd``, a pidfd, if it has one), or ``deadline`` (``time.monotonic()``) passes.
  It returns ``"done"``, ``"eof"`` or ``"timeout"`` (or ``"cpu"``: a :class:`CpuBudget` is spent) and never
  blocks past the deadline, whatever the process does (it may stop reading stdin, flood output, or hang).
* In a session the runner marks the end of a cell on stdout only (see :mod:`agentenv.sandboxes._runner`);
  stderr is then drained without waiting, saving a wake-up per call. Handles with ``mux = True`` (docker) get a
  marker on each stream and the pump waits for both.
* A :class:`Sink` keeps at most ``cap`` bytes and counts the rest, so an output flood costs reading time but no
  memory. It removes every ``tag ... \\0`` marker from the stream and keeps what follows the tag of the *last* one
  as ``status``: a cell can write the same bytes as its runner (see :mod:`.boundary`), but the runner's own marker
  is the last thing it writes before its read, where the host proves it back. A flush (``Sink.expect``) awaits a
  second tag on the same sink. A marker can be split across reads; user output that merely contains NUL bytes
  passes through unchanged.
"""

from __future__ import annotations

import select
import time

from agentenv.sandboxes.limits import TRUNCATION_MARKER

_MAX_STATUS = 256


class Sink:
    def __init__(self, cap: int, tag: bytes):
        self.cap, self.tag = cap, tag
        self.kept = bytearray()
        self.dropped = 0
        self.pending = b""  # a tail that may be the start of a marker
        self.tags = [tag]  # every tag stripped from the stream; the last one is the one awaited
        self.statuses: dict[bytes, bytes] = {}  # tag -> the status of its LAST marker

    @property
    def found(self) -> bool:
        """Has the awaited tag's marker been seen?"""
        return self.tags[-1] in self.statuses

    @property
    def status(self) -> bytes:
        """The status of the last marker with the call's own tag (b"" if none)."""
        return self.statuses.get(self.tag, b"")

    def expect(self, tag: bytes) -> None:
        """Await a further marker ``tag`` (a flush); markers of the earlier tags are still stripped and read."""
        self.tags.append(tag)

    def _first(self, buf) -> tuple[int, bytes]:
        best, which = -1, b""
        for tag in self.tags:
            i = buf.find(tag)
            if i >= 0 and (best < 0 or i < best):
                best, which = i, tag
        return best, which

    def feed(self, data: bytes) -> None:
        buf = self.pending + data if self.pending else data
        self.pending = b""
        while True:
            i, tag = self._first(buf)
            if i < 0:
                break
            k = i + len(tag)
            j = buf.find(b"\0", k, k + _MAX_STATUS)
            if j < 0 and len(buf) - k < _MAX_STATUS:
                self._keep(buf[:i])
                self.pending = buf[i:]  # the status has not fully arrived yet
                return
            if j < 0:  # no status end within reach: not a marker after all
                self._keep(buf[:k])
                buf = buf[k:]
                continue
            self._keep(buf[:i])
            self.statuses[tag] = bytes(buf[k:j])
            buf = buf[j + 1:]
        longest = max(map(len, self.tags))
        if b"\0" in buf[-longest + 1:]:  # the tags start with NUL: only then can a tail be a prefix of one
            cut = max(0, len(buf) - longest + 1)
            self._keep(buf[:cut])
            self.pending = buf[cut:]
            return
        self._keep(buf)

    def _keep(self, b: bytes) -> None:
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += b[:room]
        self.dropped += max(0, len(b) - max(room, 0))

    def text(self) -> str:
        if self.pending:
            self._keep(self.pending)
            self.pending = b""
        s = self.kept.decode("utf-8", "replace")
        return s + TRUNCATION_MARKER.format(dropped=self.dropped) if self.dropped else s


def drain(proc, out: Sink, err: Sink) -> None:
    """Read whatever ``proc`` has already written (for a writer proven stopped: all of it), without waiting."""
    _drain(proc, list(proc.rfds), {1: out, 2: err})


class CpuBudget:
    """A call's CPU seconds, metered from outside the sandbox (``meter()``: its cgroup's usage, every task counted),
    so no code inside can raise it. The tree cannot spend them faster than ``cpus`` cores (its cgroup's quota),
    so the meter is read only at the earliest moment the budget could be gone (:attr:`check_at`): nothing at all
    for a call that ends sooner."""

    def __init__(self, meter, limit_s: float, cpus: float):
        self.meter, self.limit, self.cpus = meter, limit_s, cpus
        self.start = meter()
        self.check_at = time.monotonic() + limit_s / cpus

    def spent(self) -> bool:
        """Read at :attr:`check_at`: True once the budget is used up, else the next check is scheduled."""
        used = self.meter() - self.start
        if used >= self.limit:
            return True
        self.check_at = time.monotonic() + max((self.limit - used) / self.cpus, 0.005)
        return False


def _drain(proc, fds, sinks, max_reads: int = 64) -> None:
    """Read what is already there, without waiting (bounded: a background writer may never stop)."""
    for fd in list(fds):
        for _ in range(max_reads):
            chunks = proc.read(fd)
            if not chunks:
                break
            for stream, data in chunks:
                sinks[stream].feed(data)


def pump(proc, payload: bytes, deadline: float, out: Sink, err: Sink, stop_on_markers: bool,
         cpu: CpuBudget | None = None) -> str:
    """Exchange bytes with ``proc`` (a PipeProc-like handle) until done, end of file, the leader's exit, the
    deadline, or ``cpu`` spent ("cpu"). ``proc.poller`` has its read fds (and ``exit_fd``, if any) registered for
    POLLIN."""
    pending = memoryview(payload)
    if pending:
        pending = pending[proc.write(pending):]  # a cell usually fits the pipe buffer: no POLLOUT round trip
    open_fds = set(proc.rfds)
    sinks = {1: out, 2: err}
    exit_fd = getattr(proc, "exit_fd", None)
    poller, wfd = proc.poller, proc.wfd
    shared = wfd in open_fds  # docker reads and writes one socket
    if pending:
        (poller.modify if shared else poller.register)(wfd, select.POLLOUT | (select.POLLIN if shared else 0))
    mux = getattr(proc, "mux", False)  # streams re-multiplexed (docker): wait for stderr's own marker
    try:
        while True:
            if stop_on_markers and out.found and (err.found or not mux):
                if not mux:  # stderr written before the stdout marker is already in its pipe
                    _drain(proc, open_fds, sinks)
                return "done"
            if not open_fds:
                return "eof"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if cpu is not None and now >= cpu.check_at and cpu.spent():
                return "cpu"
            left = min(deadline, cpu.check_at) - now if cpu is not None else deadline - now
            for fd, ev in poller.poll(max(left, 0) * 1000):
                if fd == exit_fd:  # whatever it wrote is in the pipes now; children still writing are cut off
                    _drain(proc, open_fds, sinks)
                    return "done" if stop_on_markers and out.found and (err.found or not mux) else "eof"
                if pending and fd == wfd:
                    if ev & select.POLLOUT:
                        pending = pending[proc.write(pending):]
                    elif not shared:  # POLLERR/POLLHUP: nobody will ever read the rest
                        pending = pending[:0]
                    if not pending:
                        (poller.modify(wfd, select.POLLIN) if shared else poller.unregister(wfd))
                if fd in open_fds and ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    chunks = proc.read(fd)
                    if chunks is None:
                        open_fds.discard(fd)
                        poller.unregister(fd)
                        continue
                    for stream, data in chunks:
                        sinks[stream].feed(data)
    finally:
        if pending and (not shared or wfd in open_fds):  # leave the poller as we found it
            (poller.modify(wfd, select.POLLIN) if shared else poller.unregister(wfd))
