r"""PythonToolEnv: math / reasoning tasks with one ``python`` tool whose code runs in the project's sandbox.

Contract (on top of :class:`~agentenv.envs.tool_env.ToolEnv`):

* One tool, ``python(code: str)``. The code runs in :mod:`agentenv.sandboxes` (``backend`` = ``"bubblewrap"`` by
  default, ``"docker"`` or ``"subprocess"``; ``limits`` = a :class:`~agentenv.sandboxes.Limits`).
  ``require_isolation=True`` refuses to make the env (and fails preflight) unless namespaces, the seccomp filter
  and cgroups are all active; otherwise a missing layer costs only a loud warning.
* STATE PERSISTS WITHIN AN EPISODE (``persistent=True``, the default): all calls of one episode run in one sandboxed
  interpreter session, so variables, imports and functions defined in call 1 exist in call 2 -- as in a notebook.
  The session is started lazily at the first call and closed when the episode ends (final answer or turn limit),
  on ``reset``, on ``close`` and when the env is garbage-collected; episodes never share state. If a call kills the
  interpreter (timeout, memory), the next call gets a fresh one and the tool message says that state was lost.
  With ``persistent=False`` every call is a fresh process (nothing carries over). ``pool=`` a
  :class:`~agentenv.sandboxes.SandboxPool` (its limits and backend; many envs may share one): each episode takes a
  warm session from it at its first call and hands it back (its interpreter killed) when the episode ends.
* The tool message is the call's stdout, then its stderr (tracebacks), then markers for what went wrong: a non-zero
  exit, a timeout, an exceeded memory / CPU limit, truncated output, a restarted interpreter. An empty output says
  so (and reminds the model to ``print``). As in a notebook, a trailing bare expression's repr is echoed. A call that is not ``ok`` (non-zero exit or any limit hit) counts as a
  tool error; a timeout also as a tool timeout.
* One assistant message may hold several calls; together they get at most ``message_timeout_s`` seconds of wall
  time (default: twice ``limits.timeout_s``). Each call runs with ``timeout_s`` (and ``cpu_s``) cut to what is
  left of that budget, and a call with nothing left is not run: its result says so and counts as a tool timeout.
  So 5 x ``sleep(100)`` in one message costs the budget, not 5 x the per-call timeout.
* Tasks: ``tasks=None`` uses :func:`builtin_tasks` (``num_tasks`` problems generated deterministically from
  ``task_seed``: big products, modular powers, digit sums, sequence sums, counting, Fibonacci residues, prime
  counts and multi-step word problems -- all with exact integer answers that are impractical to get right without
  computing); a path loads a JSONL / Parquet file of (question, answer) rows; a list of tasks / mappings is used as
  given. Answers are graded by :func:`agentenv.envs.grading.grade_answer` (``\boxed{}``; an integer answer must be
  exact).
"""

from __future__ import annotations

import math
import os
import random
import time
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping

from agentenv.envs.tasks import Task
from agentenv.envs.tool_env import ToolEnv
from agentenv.envs.tools import Tool, ToolOutput

SYSTEM_PROMPT = (
    "Solve the user's math problem. You can run Python code with the `python` tool; variables you define persist "
    "between calls in this conversation, and you see what the code prints. When you know the answer, reply without "
    "a tool call and put the final answer in \\boxed{}."
)

PYTHON_DOC = """Run Python 3 code in a sandbox and return what it prints (stdout, then stderr).

Use print() to see values; the value of a final bare expression is also shown, as in a notebook. {state} Runs are limited to {timeout:g} s and {memory} MB; there is no network.

Args:
    code: Python source code to execute.
"""


# --- built-in tasks -------------------------------------------------------------------------------------------------

def _product(r: random.Random) -> tuple[str, int]:
    a, b = r.randrange(10**6, 10**9), r.randrange(10**6, 10**9)
    return f"Compute {a} * {b}.", a * b


def _modpow(r: random.Random) -> tuple[str, int]:
    base, exp, mod = r.randrange(2, 1000), r.randrange(10**5, 10**7), r.choice([10**9 + 7, 998244353, 1000003, 65537])
    return f"What is {base}^{exp} mod {mod}?", pow(base, exp, mod)


def _digit_sum(r: random.Random) -> tuple[str, int]:
    k = r.randrange(200, 1500)
    return f"What is the sum of the decimal digits of 2^{k}?", sum(map(int, str(2**k)))


def _series(r: random.Random) -> tuple[str, int]:
    n, p, d = r.randrange(500, 5000), r.choice([2, 3]), r.choice([3, 5, 7, 11])
    power = "squares" if p == 2 else "cubes"
    return (f"What is the sum of the {power} of all integers k from 1 to {n} that are not divisible by {d}?",
            sum(k**p for k in range(1, n + 1) if k % d))


def _count(r: random.Random) -> tuple[str, int]:
    n = r.randrange(10**5, 10**6)
    a, b, c = r.sample([3, 4, 6, 7, 9, 11, 13], 3)
    lcm = math.lcm
    # Inclusion-exclusion, |A u B| - |(A u B) n C| (a brute-force check of it is in the tests).
    answer = n // a + n // b - n // lcm(a, b) - (n // lcm(a, c) + n // lcm(b, c) - n // lcm(a, b, c))
    return f"How many integers from 1 to {n} (inclusive) are divisible by {a} or by {b}, but not by {c}?", answer


def _fib(r: random.Random) -> tuple[str, int]:
    n, m = r.randrange(1000, 20000), r.choice([1000, 9973, 10**6 + 3, 123457])
    x, y = 0, 1
    for _ in range(n):
        x, y = y, (x + y) % m
    return f"Let F(1) = F(2) = 1 and F(n) = F(n-1) + F(n-2). What is F({n}) mod {m}?", x


def _primes(r: random.Random) -> tuple[str, int]:
    n = r.randrange(10**4, 2 * 10**5)
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
    return f"How many prime numbers are less than {n}?", sum(sieve)


def _word(r: random.Random) -> tuple[str, int]:
    crates, boxes, bottles = r.randrange(120, 900), r.randrange(12, 48), r.randrange(6, 30)
    total = crates * boxes * bottles
    days = r.randrange(20, 90)
    per_day = r.randrange(total // (3 * days), total // days)
    broken = r.randrange(3, 9)  # percent of the remaining bottles, rounded down
    left = total - per_day * days
    answer = left - left * broken // 100
    return (f"A warehouse holds {crates} crates; each crate holds {boxes} boxes and each box holds {bottles} bottles. "
            f"Every day {per_day} bottles are shipped out. After {days} days an inspection finds that {broken}% of the "
            "remaining bottles (rounded down to a whole number) are broken and throws them away. How many bottles are "
            "left?", answer)


TASK_FAMILIES = {"product": _product, "modpow": _modpow, "digit_sum": _digit_sum, "series": _series,
                 "count": _count, "fibonacci": _fib, "primes": _primes, "word": _word}


def builtin_tasks(n: int = 64, seed: int = 0) -> list[Task]:
    """``n`` tasks cycling through :data:`TASK_FAMILIES`, generated from ``seed`` (same seed, same tasks)."""
    r = random.Random(seed)
    families = list(TASK_FAMILIES.items())
    tasks = []
    for i in range(n):
        kind, make = families[i % len(families)]
        question, answer = make(r)
        tasks.append(Task(question, str(answer), id=f"py-{seed}-{i}", type=kind))
    return tasks


# --- the sandboxed interpreter --------------------------------------------------------------------------------------

class _Slot:
    """Holds the episode's sandbox session (from ``pool`` when one is given, handed back at the episode's end).
    Kept apart from the env so a finalizer can close it without the env."""

    def __init__(self, pool: Any = None) -> None:
        self.session: Any = None
        self.pool = pool

    def open(self, sandbox: Any, timeout: float) -> Any:
        self.session = sandbox.session() if self.pool is None else self.pool.acquire(timeout)
        return self.session

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                session.close() if self.pool is None else self.pool.release(session)
            except Exception:  # closing must never fail an episode; the sandbox reaps its own processes
                pass


def format_result(r: Any, limits: Any) -> str:
    """The tool message for one :class:`~agentenv.sandboxes.ExecResult`."""
    parts = [p for p in (r.stdout, r.stderr) if p]
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts)
    notes = []
    if r.timed_out:
        notes.append(f"[timed out after {limits.timeout_s:g} s: execution was stopped]")
    if r.memory_exceeded:
        notes.append(f"[memory limit exceeded ({limits.memory_mb} MB)]")
    if getattr(r, "cpu_exceeded", False):
        notes.append(f"[timed out: CPU time limit of {limits.cpu_s:g} s exceeded, execution was stopped]")
    if r.output_truncated and "output truncated" not in text:
        notes.append(f"[output truncated at {limits.max_output_bytes} bytes]")
    if r.exit_code not in (0, None) and not (r.timed_out or r.memory_exceeded or getattr(r, "cpu_exceeded", False)):
        notes.append(f"[exit code {r.exit_code}]")
    if getattr(r, "session_restarted", False):
        notes.append("[the interpreter was restarted: variables, imports and functions from earlier calls are lost]")
    if not text and not notes:
        return "(no output: use print() to see values)"
    return (text + "\n".join(notes)).strip("\n")


class PythonToolEnv(ToolEnv):
    metadata = {**ToolEnv.metadata, "agentenv": {"preset": "python_tool"}}

    @classmethod
    def preflight(cls, *, splits=(), backend: str = "bubblewrap", tasks: Any = None, require_isolation: bool = False,
                  **_) -> list:
        """The sandbox backend the tool runs in, its isolation layers if required, and a task file when one is
        configured."""
        import shutil

        from agentenv.envs.spec import Check

        out = []
        if require_isolation and backend in ("bubblewrap", "subprocess"):
            from agentenv.sandboxes import isolation_gaps

            gaps = isolation_gaps(backend)
            out.append(Check("sandbox isolation", not gaps, "namespaces, seccomp, cgroups" if not gaps else
                             "require_isolation: missing " + "; ".join(gaps)))
        if backend == "bubblewrap":
            path = shutil.which("bwrap")
            out.append(Check("sandbox bubblewrap", path is not None, path or "bwrap not found: apt-get install "
                             "bubblewrap (or --set env.kwargs.backend=subprocess, UNSAFE)"))
        elif backend == "docker":
            try:
                import docker

                docker.from_env().ping()
                out.append(Check("sandbox docker", True, "engine answers"))
            except Exception as e:  # noqa: BLE001 -- any failure means the engine is not usable
                out.append(Check("sandbox docker", False, f"no Docker engine answers: {e}"))
        else:
            out.append(Check(f"sandbox {backend}", True, "configured"))
        if isinstance(tasks, (str, os.PathLike)):
            out.append(Check("tasks file", Path(tasks).exists(), str(tasks)))
        return out

    def __init__(
        self,
        tasks: Iterable[Task | Mapping[str, Any]] | str | os.PathLike | None = None,
        *,
        num_tasks: int = 64,
        task_seed: int = 0,
        backend: str = "bubblewrap",
        limits: Any = None,
        require_isolation: bool = False,
        persistent: bool = True,
        pool: Any = None,
        message_timeout_s: float | None = None,
        max_turns: int = 10,
        system_prompt: str | None = SYSTEM_PROMPT,
        tool_doc: str | None = None,
        render_mode: str | None = None,
        **kwargs: Any,
    ):
        from agentenv.sandboxes import Limits, make_sandbox  # the sandbox loads only when this env is made

        self.limits = limits if limits is not None else pool.sandbox.limits if pool is not None else Limits()
        if isinstance(self.limits, Mapping):
            self.limits = Limits(**self.limits)  # gym.make kwargs / YAML configs pass plain dicts
        if pool is not None:
            _check_pool(pool, self.limits, persistent, require_isolation)
        self.backend, self.persistent = backend, persistent
        if message_timeout_s is None:
            message_timeout_s = 2 * self.limits.timeout_s
        if isinstance(message_timeout_s, bool) or not isinstance(message_timeout_s, (int, float)) \
                or not message_timeout_s > 0:
            raise ValueError(f"message_timeout_s must be a positive number of seconds, got {message_timeout_s!r}")
        self.message_timeout_s = float(message_timeout_s)
        self._message_deadline = math.inf
        self.sandbox = pool.sandbox if pool is not None else make_sandbox(
            backend, limits=self.limits, require_isolation=require_isolation)
        state = ("Variables, imports and functions persist across calls within this conversation."
                 if persistent else "Each call starts a fresh interpreter: nothing carries over between calls.")
        # tool_doc replaces the tool's description (e.g. a terse one to keep a tiny model's prompt short).
        doc = tool_doc if tool_doc is not None else PYTHON_DOC.format(
            state=state, timeout=self.limits.timeout_s, memory=self.limits.memory_mb)
        python = Tool.from_function(_with_doc(self._python, doc), name="python")
        try:
            super().__init__(
                builtin_tasks(num_tasks, task_seed) if tasks is None else tasks,
                [python],
                system_prompt=system_prompt,
                max_turns=max_turns,
                render_mode=render_mode,
                **kwargs,
            )
        except BaseException:
            if pool is None:
                self.sandbox.close()  # e.g. a bad task file: do not leak the sandbox we already made
            raise
        self._slot = _Slot(pool)
        # Closes the session and the sandbox (e.g. the subprocess backend's temp dir; a pool's is its owner's) when
        # the env is garbage-collected or at interpreter exit, without keeping the env alive.
        self._finalizer = weakref.finalize(self, _shutdown, self._slot, self.sandbox if pool is None else None)

    def run_tools(self, action: str):
        """All calls of one message share ``message_timeout_s`` (see the module docstring)."""
        self._message_deadline = time.monotonic() + self.message_timeout_s
        try:
            return super().run_tools(action)
        finally:
            self._message_deadline = math.inf

    def _python(self, code: str) -> ToolOutput:
        left = self._message_deadline - time.monotonic()
        if left <= 0.01:
            return ToolOutput(f"[not run: the {self.message_timeout_s:g} s of tool time for one message are used up]",
                              error=True, timeout=True)
        limits = self.limits
        if left < limits.timeout_s:
            limits = limits.replace(timeout_s=left, cpu_s=min(limits.cpu_s, left))
        if self.persistent:
            session = self._slot.session
            if session is None:
                try:
                    session = self._slot.open(self.sandbox, timeout=left)
                except TimeoutError:
                    return ToolOutput(f"[not run: no sandbox of the pool came free within {left:.3g} s]", error=True,
                                      timeout=True)
            result = session.run(code, limits)
        else:
            result = self.sandbox.run(code, limits)
        # An endless loop ends on the wall timeout or the CPU limit, whichever fires first: both are a timeout.
        timeout = bool(result.timed_out or getattr(result, "cpu_exceeded", False))
        return ToolOutput(format_result(result, limits), error=not result.ok, timeout=timeout)

    def end_episode(self) -> None:
        slot = getattr(self, "_slot", None)  # end_episode may run from a failed __init__
        if slot is not None:
            slot.close()

    def close(self) -> None:
        super().close()
        self._finalizer()  # runs once: closes the session and the sandbox


def _shutdown(slot: _Slot, sandbox: Any) -> None:
    slot.close()
    if sandbox is not None:
        sandbox.close()


def _check_pool(pool: Any, limits: Any, persistent: bool, require_isolation: bool) -> None:
    """A pool serves persistent episodes whose fixed limits are the pool's (only timeout, CPU and output change
    per call), and, when isolation is required, only a pool whose sandbox has every layer."""
    from agentenv.sandboxes import SandboxPool, isolation_gaps

    if not isinstance(pool, SandboxPool):
        raise TypeError(f"pool must be an agentenv.sandboxes.SandboxPool, got {type(pool).__name__}")
    if not persistent:
        raise ValueError("pool= serves persistent sessions; with persistent=False leave it out (fresh runs take "
                         "the sandbox's ready processes)")
    fixed = {k for k in type(limits).__dataclass_fields__ if k not in ("timeout_s", "cpu_s", "max_output_bytes")
             and getattr(limits, k) != getattr(pool.sandbox.limits, k)}
    if fixed:
        raise ValueError(f"limits {sorted(fixed)} differ from the pool's; make the pool with these limits")
    gaps = isolation_gaps(pool.sandbox.name) if require_isolation else []
    if gaps:
        raise RuntimeError("require_isolation: the pool's sandbox runs without " + "; ".join(gaps))


def _with_doc(method: Any, doc: str):
    """A plain ``python(code)`` function with the given docstring (a bound method's doc is read-only) that calls
    ``method`` through a weak reference, so the env's tool table does not keep the env alive (no cycle: the env and
    its sandbox session are freed as soon as the last user reference goes)."""
    ref = weakref.WeakMethod(method)

    def python(code: str) -> ToolOutput:
        bound = ref()
        if bound is None:
            raise RuntimeError("the environment that owns this tool no longer exists")
        return bound(code)

    python.__doc__ = doc
    return python
