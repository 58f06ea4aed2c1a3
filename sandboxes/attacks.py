"""A catalogue of real hostile programs, and the judge that decides whether a sandbox contained each one.

Used by ``agentenv sandbox check`` (to prove isolation on this machine) and by the security tests.

Contract: every attack first prints ``RAN uid=<uid>`` (proof that the hostile code really executed: a sandbox that
runs nothing contains nothing), and prints ``ESCAPED ...`` when it achieves its goal from the inside. An attack is
*contained* when it ran, printed no ``ESCAPED``, its own extra expectation holds (the right limit flag, output
capped, ...), a host-side probe saw nothing (no connection on the host's listening port, no file written on the
host, the host's bystander process still alive), it ended within its limit plus ``MARGIN_S``, and no process of
its uid or with its marker is left afterwards. ``$name`` placeholders are filled from :class:`Target`.
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


ATTACKS = [
    Attack("dns", "no DNS resolution", """
import socket
for host in ("example.com", "pypi.org"):
    try:
        print("ESCAPED resolved", host, socket.getaddrinfo(host, 443)[0][4])
    except OSError as e:
        print("blocked", host, e)
"""),
    Attack("tcp_localhost", "no connection to services on the host's 127.0.0.1", """
import socket
try:
    socket.create_connection(("127.0.0.1", $port), timeout=1)
    print("ESCAPED connected to host port $port")
except OSError as e:
    print("blocked", e)
""", host_check=_no_connection),
    Attack("tcp_udp_outside", "no network egress (TCP/UDP to the internet)", """
import socket
for addr in (("1.1.1.1", 53), ("8.8.8.8", 443), ("93.184.216.34", 80)):
    try:
        socket.create_connection(addr, timeout=1)
        print("ESCAPED tcp", addr)
    except OSError as e:
        print("blocked tcp", addr, e)
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.sendto(b"x", ("8.8.8.8", 53))
    print("ESCAPED udp datagram left")
except OSError as e:
    print("blocked udp", e)
"""),
    Attack("host_files", "host files are invisible (secrets under /root, /etc/shadow)", """
for p in ("$secret_file", "/etc/shadow", "/root/.bash_history", "/proc/1/root$secret_file"):
    try:
        print("ESCAPED read", p, open(p).read()[:40])
    except OSError as e:
        print("blocked", p, type(e).__name__)
"""),
    Attack("env_secret", "the host's environment variables do not leak", """
import os
if "$secret_value" in repr(dict(os.environ)):
    print("ESCAPED secret in os.environ")
for p in ("/proc/self/environ", "/proc/1/environ", "/proc/2/environ"):
    try:
        if b"$secret_value" in open(p, "rb").read():
            print("ESCAPED secret in", p)
    except OSError as e:
        print("blocked", p, type(e).__name__)
"""),
    Attack("write_outside", "nothing outside the private /tmp is writable", """
for p in ("$host_dir/escaped.txt", "/usr/escaped.txt", "/escaped.txt", "/root/escaped.txt", "/proc/1/root/escaped.txt"):
    try:
        with open(p, "w") as f:
            f.write("x")
        print("wrote (inside the sandbox only?)", p)
    except OSError as e:
        print("blocked", p, type(e).__name__)
""", host_check=_nothing_written),
    Attack("fork_bomb", "process count is capped (fork bomb)", """
import os, time
kids = 0
while kids < 1000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids += 1
print("forks allowed:", kids, flush=True)
if kids >= $max_processes:
    print("ESCAPED forked", kids)
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
""", expect=_flag("timed_out")),
    Attack("memory_bomb", "memory is capped (MemoryError, host untouched)", """
blocks = []
for _ in range($memory_mb * 4 // 16):
    blocks.append(bytearray(16 << 20))
print("ESCAPED allocated", len(blocks) * 16, "MB")
""", expect=_flag("memory_exceeded")),
    Attack("cpu_spin", "CPU time is capped", """
while True:
    pass
""", expect=_flag("cpu_exceeded"), limits={"timeout_s": 5.0}),
    Attack("disk_fill", "disk writes are capped (private tmpfs size, largest file)", """
import os
total = n = 0
try:
    while True:
        with open(f"/tmp/fill{n}", "wb") as f:
            for _ in range(4):
                f.write(bytes(1 << 20))
                total += 1 << 20
        n += 1
except OSError as e:
    print("disk full after", total >> 20, "MB:", e)
if total > ($disk_mb + 8) << 20:
    print("ESCAPED wrote", total >> 20, "MB")
for i in range(n + 1):
    if os.path.exists(f"/tmp/fill{i}"):
        os.remove(f"/tmp/fill{i}")
size = 0
try:
    with open("/tmp/big", "wb") as f:
        while size < (4 * $max_file_mb) << 20:
            f.write(bytes(1 << 20))
            f.flush()
            size += 1 << 20
    print("ESCAPED one file of", size >> 20, "MB")
except OSError as e:
    print("big file stopped at", size >> 20, "MB:", e)
"""),
    Attack("output_flood", "output is capped while reading (no unbounded buffering)", """
import sys
while True:
    sys.stdout.write("A" * 65536)
    sys.stderr.write("B" * 65536)
""", expect=lambda r, lim: _capped(r, lim) or (None if r.timed_out or r.cpu_exceeded else "expected a time limit to stop it")),
    Attack("sleeping_children", "a timeout kills the whole tree, daemons included", """
import os, subprocess, time
subprocess.Popen(["/usr/bin/sleep", "$marker"])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/usr/bin/sleep", ["sleep", "$marker"])
    os._exit(0)
time.sleep(100)
""", expect=_flag("timed_out")),
    Attack("orphans_after_exit", "no process outlives a program that exits normally", """
import os, subprocess
subprocess.Popen(["/usr/bin/sleep", "$marker"])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/usr/bin/sleep", ["sleep", "$marker"])
    os._exit(0)
""", expect=_exited_fast),
    Attack("signal_parent", "signals cannot reach the host (kill getppid(), kill 1, kill -9 -1)", """
import os, signal
for pid in (os.getppid(), 1, $bystander_pid):
    try:
        os.kill(pid, signal.SIGKILL)
        print("ESCAPED killed", pid)
    except OSError as e:
        print("blocked kill", pid, type(e).__name__)
try:
    os.kill(-1, signal.SIGKILL)
except OSError as e:
    print("kill -9 -1:", type(e).__name__)
print("survived kill -9 -1")
""", host_check=_bystander_alive),
    Attack("proc_snoop", "host processes are invisible in /proc", """
import os
pids = [p for p in os.listdir("/proc") if p.isdigit()]
print("visible pids:", pids)
if "$bystander_pid" in pids or len(pids) > 10:
    print("ESCAPED sees host processes")
for p in ("/proc/$bystander_pid/cmdline", "/proc/$bystander_pid/environ"):
    try:
        open(p).read()
        print("ESCAPED read", p)
    except OSError as e:
        print("blocked", p, type(e).__name__)
"""),
    Attack("privileges", "no root, no capabilities, no way back to uid 0", """
import os
if 0 in (os.getuid(), os.geteuid(), os.getgid()) or 0 in os.getgroups():
    print("ESCAPED running as root")
for name, f in (("setuid", lambda: os.setuid(0)), ("setgid", lambda: os.setgid(0))):
    try:
        f()
        print("ESCAPED", name, "0")
    except OSError as e:
        print("blocked", name, type(e).__name__)
for line in open("/proc/self/status"):
    if line.startswith(("CapEff", "CapPrm", "CapBnd", "CapAmb")) and int(line.split()[1], 16):
        print("ESCAPED capability set", line.strip())
"""),
]


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
        self._old_env = os.environ.get(self.secret_env)
        os.environ[self.secret_env] = self.secret_value

    def code(self, attack: Attack, limits: Limits, marker: str) -> str:
        fill = dict(port=self.port, secret_file=self.secret_file, secret_value=self.secret_value,
                    host_dir=self.host_dir, bystander_pid=self.bystander.pid, marker=marker,
                    max_processes=limits.max_processes, memory_mb=limits.memory_mb, disk_mb=limits.disk_mb,
                    max_file_mb=limits.max_file_mb)
        return 'import os\nprint("RAN uid=%d" % os.getuid(), flush=True)\n' + \
            string.Template(attack.code).substitute(fill)

    def close(self) -> None:
        self.listener.close()
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


def judge(sandbox, attack: Attack, target: Target, base: Limits = LIMITS) -> Verdict:
    limits = base.replace(**attack.limits)
    marker = f"{313 + secrets.randbelow(600)}.{secrets.randbelow(10**6)}"  # a unique `sleep` duration
    meter = _LagMeter()
    meter.start()
    try:
        r = sandbox.run(target.code(attack, limits, marker), limits)
    finally:
        meter.stop.set()
        meter.join()
    problems = []
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
