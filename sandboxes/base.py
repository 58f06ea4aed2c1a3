"""The backend-independent half of a sandbox: fresh runs, persistent sessions and how results are read.

Contract:

* A backend subclasses :class:`Sandbox` and implements only ``_start(mode, limits)``, returning a process handle
  (``rfds``/``wfd``/``read``/``write``/``wait``/``kill``/``oom_killed``, see :mod:`agentenv.sandboxes.process`)
  running :mod:`agentenv.sandboxes._runner` in ``mode`` ``"once"`` or ``"session"``.
* ``Sandbox.run(code)`` runs ``code`` like ``python file.py`` in a fresh process per call and always kills the
  whole tree before returning. A backend with ``ready_depth > 0`` keeps that many fresh processes started ahead
  of need for its default limits (:mod:`.ready`), so a call takes one instead of waiting for its start.
  ``timeout_s`` and ``wall_time_s`` count from the moment the process was taken or started (bubblewrap: ~15 ms
  before; a container engine: up to seconds).
* ``Sandbox.session()`` returns a :class:`Session`: one interpreter whose globals survive between ``run`` calls,
  which behave like notebook cells (a trailing expression is echoed with its repr; ``sys.exit`` ends only the cell).
  A call that times out or kills the interpreter (crash, ``os._exit``, CPU limit) kills the tree and starts a fresh
  interpreter at once; that call's result has ``session_restarted=True``: every earlier definition is gone.
  A call ends only when the backend proves the interpreter back at the runner's read (bubblewrap with a cgroup:
  :mod:`agentenv.sandboxes.boundary`; the end-of-cell marker alone can be forged by the cell), and whatever the
  cell left that could still run (a thread, a child, a signal handler on a timer) is frozen until the next cell:
  it gets CPU only inside a call, under that call's limits. A cell that never lets the runner get back to its
  read runs until the call's deadline and is then treated as a timeout.
  ``run(limits=...)`` on a session may change ``timeout_s``, ``cpu_s`` and ``max_output_bytes`` per call; the
  process-wide limits are fixed when the interpreter starts.
* Sessions die with ``close()``, with their sandbox's ``close()``, when garbage-collected, and at interpreter exit.
"""

from __future__ import annotations

import itertools
import math
import secrets
import signal
import threading
import time
import weakref
from pathlib import Path

from agentenv.sandboxes.channel import CpuBudget, Sink, drain, pump
from agentenv.sandboxes.limits import ExecResult, Limits
from agentenv.sandboxes.ready import ReadyQueue

RUNNER_SOURCE = (Path(__file__).parent / "_runner.py").read_text()  # run as `python -S -I -c RUNNER_SOURCE ...`
_PER_CALL = {"timeout_s", "cpu_s", "max_output_bytes"}


def runner_args(mode: str, limits: Limits) -> list[str]:
    """The runner's argv after ``-c SOURCE``: mode, address space, CPU seconds, processes, largest file (bytes),
    open files."""
    return [mode, str(limits.memory_mb << 20), str(math.ceil(limits.cpu_s)), str(limits.max_processes),
            str(limits.max_file_mb << 20), str(limits.max_open_files)]


def _check_code(code) -> bytes:
    if not isinstance(code, str):
        raise TypeError(f"sandbox code must be str, got {type(code).__name__}")
    return code.encode("utf-8", "surrogatepass")


def _cell(code: str, nonce: bytes, limits: Limits) -> bytes:
    body = _check_code(code)
    return b"%d %s %d\n" % (len(body), nonce, math.ceil(limits.cpu_s)) + body


def _status(status: bytes) -> tuple[int, bytes]:
    """(exit code, exception name) from an end marker's ``:<code>:<ExcName>``."""
    _, code, exc = status.split(b":", 2) if status.count(b":") >= 2 else (b"", b"1", b"")
    return int(code) if code.lstrip(b"-").isdigit() else 1, exc


def _budget(proc, limits: Limits, cpus: float) -> CpuBudget | None:
    """The call's CPU budget, metered by the sandbox's cgroup where it has one that meters CPU."""
    group = getattr(proc, "cgroup", None)
    if group is None or group.destroyed or not group.meters_cpu:
        return None
    return CpuBudget(group.cpu_seconds, limits.cpu_s, cpus)


def _result(out: Sink, err: Sink, code, timed_out, exc: bytes, proc, started, backend,
            cpu_spent: bool = False) -> ExecResult:
    oom = proc.oom_killed  # read every time: a cgroup reports each OOM kill once
    return ExecResult(
        stdout=out.text(), stderr=err.text(), exit_code=code, timed_out=timed_out,
        memory_exceeded=exc == b"MemoryError" or oom,
        cpu_exceeded=code == 128 + signal.SIGXCPU or cpu_spent,
        output_truncated=bool(out.dropped or err.dropped),
        wall_time_s=time.monotonic() - started, backend=backend)


class Sandbox:
    name = "?"
    unsafe = False
    ready_depth = 0  # fresh processes kept started ahead of need (:mod:`.ready`); backends opt in
    cpus = 1.0  # cores a sandbox's cgroup may use: how fast it can spend a CPU budget (:class:`.channel.CpuBudget`)

    def __init__(self, limits: Limits | None = None):
        if limits is not None and not isinstance(limits, Limits):
            raise TypeError(f"limits must be agentenv.sandboxes.Limits, got {type(limits).__name__}")
        self.limits = limits or Limits()
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._ready: ReadyQueue | None = None
        self.closed = False

    def _take_ready(self, limits: Limits):
        """A fresh process started ahead of need for ``limits`` (:mod:`.ready`), or None."""
        if self.ready_depth <= 0:
            return None
        if self._ready is None:
            self._ready = ReadyQueue(self, self.limits, self.ready_depth)
            weakref.finalize(self, self._ready.close)
        return self._ready.take(limits)

    def _start(self, mode: str, limits: Limits):
        raise NotImplementedError

    def _limits(self, limits: Limits | None) -> Limits:
        if self.closed:
            raise RuntimeError(f"{self.name} sandbox is closed")
        if limits is not None and not isinstance(limits, Limits):
            raise TypeError(f"limits must be agentenv.sandboxes.Limits, got {type(limits).__name__}")
        return limits or self.limits

    def run(self, code: str, limits: Limits | None = None) -> ExecResult:
        limits = self._limits(limits)
        nonce = secrets.token_hex(8).encode()
        payload = _cell(code, nonce, limits)
        tag = b"\0\x1eAE" + nonce
        out, err = Sink(limits.max_output_bytes, tag), Sink(limits.max_output_bytes, tag)
        proc = self._take_ready(limits) or self._start("once", limits)
        started = time.monotonic()  # the code's time starts now: a slow engine's container start is not its fault
        deadline = started + limits.timeout_s
        try:
            # The end marker (after the program's atexit handlers) ends the run: the tree is killed next anyway,
            # so a marker the program forges only cuts its own run short; the interpreter's teardown is not waited for.
            state = pump(proc, payload, deadline, out, err, stop_on_markers=True,
                         cpu=_budget(proc, limits, self.cpus))
            if state == "done":
                drain(proc, out, err)
            code = proc.wait(deadline - time.monotonic()) if state == "eof" else None
        finally:
            proc.kill()  # also takes down children a subprocess-backend script left behind in its group
        exc = b""
        if state == "done":
            code, exc = _status(out.status)
        return _result(out, err, code, state == "timeout" or (state == "eof" and code is None), exc, proc, started,
                       self.name, cpu_spent=state == "cpu")

    def session(self, limits: Limits | None = None) -> Session:
        s = Session(self, self._limits(limits))
        self._sessions.add(s)
        return s

    def close(self) -> None:
        self.closed = True
        if self._ready is not None:
            self._ready.close()
        for s in list(self._sessions):
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _kill(proc):
    proc.kill()


def _prove(proc, at_rest, deadline: float, out: Sink, err: Sink, cpu: CpuBudget | None) -> str:
    """Look (with backoff, reading output meanwhile) until ``at_rest()``: "done", or "eof"/"timeout"/"cpu"."""
    wait = 0.0005
    while not at_rest():
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        state = pump(proc, b"", time.monotonic() + min(wait, left), out, err, stop_on_markers=False, cpu=cpu)
        if state in ("eof", "cpu"):
            return state
        wait = min(wait * 2, 0.02)
    return "done"


def _settle(proc, deadline: float, out: Sink, err: Sink, limits: Limits, cpu: CpuBudget | None) -> str:
    """After the end-of-cell marker: "done" once the interpreter is provably back at the runner's read (frozen
    if need be, see :mod:`agentenv.sandboxes.boundary`) and everything the cell wrote has been read, else "eof"
    (the leader exited) or "timeout". The marker only starts the proof: a cell can write it too.

    Over pipes, a writer proven stopped has all its output in the pipes already: read it without waiting. Over a
    relayed stream (docker's, ``proc.mux``) it may still be in flight, so the host sends a flush: an empty cell
    under a random nonce drawn after the proof, which no code of the cell can have seen. The runner answers it
    only after all it wrote before. (A leftover thread or child, thawed for that answer, could take the flush
    from the pipe; the runner then never answers and the call times out.) After the answer the proof is
    repeated, since the runner had to run to answer."""
    at_rest = getattr(proc, "at_rest", None)
    if at_rest is None:  # a backend without a host-side view of its interpreter: the marker is all there is
        return "done"
    state = _prove(proc, at_rest, deadline, out, err, cpu)
    if state != "done" or getattr(proc, "boundary", True) is None:  # nothing was proven: nothing to flush
        return state
    if not getattr(proc, "mux", False):
        drain(proc, out, err)
        return "done"
    nonce = secrets.token_hex(8).encode()
    payload, tag = _cell("", nonce, limits), b"\0\x1eAE" + nonce
    out.expect(tag)
    err.expect(tag)
    proc.thaw()
    state = pump(proc, payload, deadline, out, err, stop_on_markers=True, cpu=cpu)
    return _prove(proc, at_rest, deadline, out, err, cpu) if state == "done" else state


class Session:
    """A persistent interpreter inside one sandbox; see the module docstring for restart semantics."""

    def __init__(self, sandbox: Sandbox, limits: Limits):
        self.sandbox, self.limits = sandbox, limits
        self.restarts = 0
        self.calls = 0
        self.closed = False
        self._lock = threading.Lock()
        self._proc = None
        self._finalizer = None
        self._salt, self._count = secrets.token_hex(4).encode(), itertools.count()
        self._spawn()

    def _spawn(self):
        self._proc = self.sandbox._start("session", self.limits)
        self._finalizer = weakref.finalize(self, _kill, self._proc)  # GC or interpreter exit: no orphan

    def _stop(self):
        if self._proc is not None:
            self._finalizer.detach()
            self._proc.kill()
            self._proc = None

    def run(self, code: str, limits: Limits | None = None) -> ExecResult:
        limits = limits or self.limits
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be agentenv.sandboxes.Limits, got {type(limits).__name__}")
        fixed = limits is not self.limits and {k for k in Limits.__dataclass_fields__ if k not in _PER_CALL
                                                and getattr(limits, k) != getattr(self.limits, k)}
        if fixed:
            raise ValueError(f"a session's {sorted(fixed)} are fixed when it starts; only {sorted(_PER_CALL)} "
                             "may change per call (open a new session for other limits)")
        nonce = b"%s%x" % (self._salt, next(self._count))  # unique per call: a late marker of an earlier call is output
        payload = _cell(code, nonce, limits)
        with self._lock:
            if self.closed:
                raise RuntimeError("session is closed")
            if self._proc is None:
                self._spawn()
            self.calls += 1
            proc = self._proc
            started = time.monotonic()
            deadline = started + limits.timeout_s
            tag = b"\0\x1eAE" + nonce
            out, err = Sink(limits.max_output_bytes, tag), Sink(limits.max_output_bytes, tag)
            thaw = getattr(proc, "thaw", None)
            if thaw is not None:
                thaw()
            cpu = _budget(proc, limits, self.sandbox.cpus)
            state = pump(proc, payload, deadline, out, err, stop_on_markers=True, cpu=cpu)
            if state == "done":
                state = _settle(proc, deadline, out, err, limits, cpu)
            if state == "done":
                code, exc = _status(out.status)
                return _result(out, err, code, False, exc, proc, started, self.sandbox.name)
            # Timed out or the interpreter died: nothing of its state can be trusted, so replace it.
            code = None if state in ("timeout", "cpu") else proc.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            self._stop()
            self.restarts += 1
            r = _result(out, err, code, state == "timeout", b"", proc, started, self.sandbox.name,
                        cpu_spent=state == "cpu")
            r.session_restarted = True
            self._spawn()
            return r

    def reset(self) -> None:
        """Throw the interpreter away and start a fresh one (all state is lost)."""
        with self._lock:
            self._stop()
            if not self.closed:
                self._spawn()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._stop()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.wait(0) is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
