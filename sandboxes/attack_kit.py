"""The machinery of the attack suite: what an attack is, the host-side bait, and the judge of containment.

Contract: every attack first prints ``RAN uid=<uid>`` (proof that the hostile code really executed: a sandbox that
runs nothing contains nothing), and prints ``ESCAPED ...`` when it achieves its goal from the inside. An attack is
*contained* when it ran, printed no ``ESCAPED``, its own extra expectation holds (the right limit flag, output
capped, ...), a host-side probe saw nothing (no connection on the host's listening port, no file written on the
host, the host's bystander process still alive), it ended within its limit plus ``MARGIN_S``, and no process of
its uid or with its marker is left afterwards. ``$name`` placeholders are filled from :class:`Target`.

A *session* attack (``session=True``) runs its code as one cell of a session, lets ``IDLE_S`` pass, then runs
``then`` as the next cell. Lines ``BEAT <time.monotonic()>`` that the hostile code prints whenever it gets CPU
(they wait in the pipe if no call is reading) prove it ran between the two calls when their time falls in that
gap; a first cell whose ``CELL DONE`` line arrives only with the second call had its call end before it did.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import string
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from agentenv.sandboxes.limits import ExecResult, Limits

IDLE_S = 1.0  # the gap between a session attack's two calls
MARGIN_S = 1.5  # kill + namespace tear-down + a loaded 2-core host
LIMITS = Limits(timeout_s=2.0, cpu_s=1.0, memory_mb=256, max_processes=16, max_output_bytes=65536,
                max_file_mb=8, disk_mb=32)


@dataclass
class Attack:
    name: str
    guarantee: str
    code: str
    expect: Callable[[ExecResult, Limits], str | None] = lambda r, lim: None
    host_check: Callable[[Target], str | None] = lambda t: None
    limits: dict = field(default_factory=dict)
    then: str | None = None  # a second program: in a fresh sandbox (cross-episode leaks), or the next cell
    session: bool = False  # run as a session cell, then ``then`` as the next cell after IDLE_S


def _flag(name: str):
    return lambda r, lim: None if getattr(r, name) else f"expected {name}"


def _capped(r: ExecResult, lim: Limits) -> str | None:
    slack = 200  # the truncation marker line
    if not r.output_truncated or len(r.stdout.encode()) > lim.max_output_bytes + slack:
        return f"output not capped (truncated={r.output_truncated}, {len(r.stdout)} chars kept)"
    return None


def _exited_fast(r: ExecResult, lim: Limits) -> str | None:
    return None if r.exit_code == 0 and r.wall_time_s < 1.0 + MARGIN_S else "did not end when its main program did"


def _no_connection(t: Target) -> str | None:
    try:
        conn, addr = t.listener.accept()
        conn.close()
        return f"host listener got a connection from {addr}"
    except BlockingIOError:
        return None


def _nothing_written(t: Target) -> str | None:
    found = [p for p in (t.host_dir / "escaped.txt", Path("/usr/escaped.txt"), Path("/root/escaped.txt"),
                         Path("/escaped.txt")) if p.exists()]
    return f"wrote on the host: {found}" if found else None


def _bystander_alive(t: Target) -> str | None:
    return None if t.bystander.poll() is None else "a host process was killed"


def _no_abstract_connection(t: Target) -> str | None:
    try:
        conn, _ = t.abstract.accept()
        conn.close()
        return "the host's abstract unix socket got a connection"
    except BlockingIOError:
        return None



class Target:
    """Host-side bait and probes: a secret env var and file, a listening port, a bystander process, a host dir."""

    def __init__(self, secret_dir: str | None = None):
        self.secret_value = "agentenv-secret-" + secrets.token_hex(8)
        self.secret_env = "AGENTENV_SANDBOX_TEST_SECRET"
        self.secret_dir = Path(tempfile.mkdtemp(prefix=".agentenv-secret-", dir=secret_dir or Path.home()))
        self.secret_file = self.secret_dir / "secret.txt"
        self.secret_file.write_text(self.secret_value)
        self.secret_file.chmod(0o644)  # readable by anyone who can reach it: only the mount view may protect it
        self.host_dir = Path(tempfile.mkdtemp(prefix="agentenv-host-"))
        self.host_dir.chmod(0o777)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.bystander = subprocess.Popen(["sleep", "3600"])
        self.abstract_name = "agentenv-bait-" + secrets.token_hex(6)
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.abstract_name)
        self.abstract.listen(8)
        self.abstract.setblocking(False)
        self._old_env = os.environ.get(self.secret_env)
        os.environ[self.secret_env] = self.secret_value

    def code(self, attack: Attack, limits: Limits, marker: str, source: str | None = None) -> str:
        fill = dict(port=self.port, secret_file=self.secret_file, secret_value=self.secret_value,
                    host_dir=self.host_dir, bystander_pid=self.bystander.pid, marker=marker,
                    abstract_name=self.abstract_name,
                    max_processes=limits.max_processes, memory_mb=limits.memory_mb, disk_mb=limits.disk_mb,
                    max_file_mb=limits.max_file_mb)
        return 'import os\nprint("RAN uid=%d" % os.getuid(), flush=True)\n' + \
            string.Template(attack.code if source is None else source).substitute(fill)

    def close(self) -> None:
        self.listener.close()
        self.abstract.close()
        self.bystander.kill()
        self.bystander.wait()
        shutil.rmtree(self.secret_dir, ignore_errors=True)
        shutil.rmtree(self.host_dir, ignore_errors=True)
        if self._old_env is None:
            os.environ.pop(self.secret_env, None)
        else:
            os.environ[self.secret_env] = self._old_env


def leftovers(uid: int | None, marker: str) -> list[int]:
    """Host pids still running with ``uid`` (if not root) or with ``marker`` on their command line."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
            status = Path(f"/proc/{d}/status").read_text()
        except OSError:
            continue
        ruid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        state = next(line for line in status.splitlines() if line.startswith("State:")).split()[1]
        if state != "Z" and (marker.encode() in cmdline or (uid and ruid == uid)):
            found.append(int(d))
    return found


class _LagMeter(threading.Thread):
    """Host responsiveness: the worst lateness of a 20 ms sleep while the attack runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.worst, self.stop = 0.0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            t = time.monotonic()
            time.sleep(0.02)
            self.worst = max(self.worst, time.monotonic() - t - 0.02)


@dataclass
class Verdict:
    attack: Attack
    result: ExecResult
    problems: list[str]
    host_lag_s: float

    @property
    def contained(self) -> bool:
        return not self.problems


def _run_fresh(sandbox, attack: Attack, target: Target, limits: Limits, marker: str):
    r = sandbox.run(target.code(attack, limits, marker), limits)
    if attack.then is not None:  # a fresh sandbox: what can it still see of the first one?
        _append(r, sandbox.run(target.code(attack, limits, marker, attack.then), limits))
    return r, []


def _append(r: ExecResult, r2: ExecResult) -> None:
    r.stdout += r2.stdout
    r.stderr += r2.stderr
    if "RAN uid=" not in r2.stdout:  # a session cell may first show what the last one left running
        r.stdout += "SECOND RUN DID NOT RUN\n"


def _beats(text: str) -> list[float]:
    return [float(line.split()[1]) for line in text.splitlines() if line.startswith("BEAT ")]


def _run_session(sandbox, attack: Attack, target: Target, limits: Limits, marker: str):
    """Two cells IDLE_S apart; none of the hostile code's BEATs may fall between the first call's return and the
    second call's start (a beat printed during the first call may still arrive with the second: that is output,
    not CPU)."""
    with sandbox.session(limits) as s:
        r = s.run(target.code(attack, limits, marker), limits)
        returned = time.monotonic()
        time.sleep(IDLE_S)
        resumed = time.monotonic()
        r2 = s.run(target.code(attack, limits, marker, attack.then or "pass"), limits)
    problems = []
    if "CELL DONE" in r2.stdout and "CELL DONE" not in r.stdout:
        problems.append("ESCAPED the first call returned before its cell had finished")
    between = [b for b in _beats(r.stdout + r2.stdout) if returned < b < resumed]
    if between:
        problems.append(f"ESCAPED computed between cells ({len(between)} beats in the {IDLE_S:.1f} s gap)")
    _append(r, r2)
    return r, problems


def judge(sandbox, attack: Attack, target: Target, base: Limits = LIMITS) -> Verdict:
    limits = base.replace(**attack.limits)
    marker = f"{313 + secrets.randbelow(600)}.{secrets.randbelow(10**6)}"  # a unique `sleep` duration
    meter = _LagMeter()
    meter.start()
    try:
        r, beat_problems = (_run_session if attack.session else _run_fresh)(sandbox, attack, target, limits, marker)
    finally:
        meter.stop.set()
        meter.join()
    problems = ["the second run did not run"] if "SECOND RUN DID NOT RUN" in r.stdout else []
    problems += beat_problems
    ran = [line for line in r.stdout.splitlines() if line.startswith("RAN uid=")]
    if not ran:
        problems.append(f"the attack did not run (exit {r.exit_code}): {r.stderr[-300:]!r}")
    problems += [line for line in (r.stdout + r.stderr).splitlines() if "ESCAPED" in line]
    for check in (attack.expect(r, limits), attack.host_check(target)):
        if check:
            problems.append(check)
    bound = limits.timeout_s + MARGIN_S  # CPU-limited attacks are judged by their flag: wall time depends on load
    if r.wall_time_s > bound:
        problems.append(f"took {r.wall_time_s:.2f}s, limit + margin is {bound:.2f}s")
    uid = int(ran[0].split("=")[1]) if ran else None
    deadline = time.monotonic() + 2.0
    while (left := leftovers(uid if uid else None, marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        problems.append(f"processes left behind: {left}")
    if meter.worst > 2.0:
        problems.append(f"host unresponsive for {meter.worst:.2f}s")
    return Verdict(attack, r, problems, meter.worst)
