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
    then: str | None = None  # a second program, run in a fresh sandbox after the first (cross-episode leaks)


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


# Raw syscalls the attacks make through ctypes (libc has no wrapper for the keyring calls).
_SYSCALLS = """
import ctypes, errno, os, platform
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": dict(add_key=248, request_key=249, keyctl=250, unshare=272, clone=56),
      "aarch64": dict(add_key=217, request_key=218, keyctl=219, unshare=97, clone=220)}[platform.machine()]
def sys_call(name, *args):
    r = libc.syscall(NR[name], *args)
    return r, errno.errorcode.get(ctypes.get_errno(), "?") if r == -1 else ""
"""


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
""", expect=_flag("cpu_exceeded"), limits={"timeout_s": 10.0}),  # 1 s of CPU: slow on a loaded host
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
# The parent and pid 1 are the sandbox's own (its PID namespace): signalling them may end the sandbox, which is
# allowed. Reaching the host is what counts: the host-side probe checks that its bystander process survived.
for pid in (os.getppid(), 1):
    try:
        os.kill(pid, signal.SIGKILL)
        print("signalled the sandbox's own", pid)
    except OSError as e:
        print("blocked kill", pid, type(e).__name__)
try:
    os.kill($bystander_pid, signal.SIGKILL)
    print("ESCAPED killed host pid $bystander_pid")
except OSError as e:
    print("blocked kill of the host's pid", type(e).__name__)
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
    Attack("memfd_bomb", "all memory is capped, shared memory included (memfd files under the file-size limit)", """
import os
size = ($max_file_mb - 1) << 20
held = []
for i in range($memory_mb * 3 // ($max_file_mb - 1)):
    fd = os.memfd_create("bomb%d" % i)
    os.posix_fallocate(fd, 0, size)  # real pages, charged to whoever allocates them; not address space
    held.append(fd)
    print("memfd MB held:", len(held) * size >> 20, flush=True)
print("ESCAPED held", len(held) * size >> 20, "MB of shared memory")
""", expect=_flag("memory_exceeded"), limits={"timeout_s": 5.0}),
    Attack("nested_userns", "no nested user namespace (no capabilities, no uncapped tmpfs inside one)",
           _SYSCALLS + """
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
r, err = sys_call("unshare", CLONE_NEWUSER | CLONE_NEWNS)
print("unshare(NEWUSER|NEWNS):", r, err)
if r == 0:
    print("ESCAPED created a user namespace")
    try:
        open("/proc/self/setgroups", "w").write("deny")
        open("/proc/self/uid_map", "w").write("0 %d 1" % os.getuid())
        os.makedirs("/tmp/mnt", exist_ok=True)
        if libc.mount(b"none", b"/tmp/mnt", b"tmpfs", 0, b"size=1g") == 0:
            with open("/tmp/mnt/fill", "wb") as f:
                for _ in range(($disk_mb + $memory_mb) // 4 + 8):
                    f.write(bytes(4 << 20))
            print("ESCAPED wrote past disk_mb and memory_mb into a tmpfs of its own")
    except OSError as e:
        print("inside the namespace:", e)
pid = os.fork()
if pid == 0:
    r, err = sys_call("clone", CLONE_NEWUSER | 17, 0, 0, 0, 0)  # 17 = SIGCHLD
    if r == 0:
        print("ESCAPED clone(CLONE_NEWUSER)", flush=True)
        os._exit(0)
    print("clone(NEWUSER):", r, err, flush=True)
    if r > 0:
        os.waitpid(r, 0)
    os._exit(0)
os.waitpid(pid, 0)
try:
    import subprocess
    out = subprocess.run(["/usr/bin/unshare", "--user", "--map-root-user", "id", "-u"], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip() == "0":
        print("ESCAPED unshare(1) gave uid 0 in a new user namespace")
    print("unshare(1):", out.returncode, out.stderr.strip()[:80])
except OSError as e:
    print("unshare(1):", e)
"""),
    Attack("keyring_leak", "the kernel keyring cannot carry data from one sandbox to the next", _SYSCALLS + """
r, err = sys_call("add_key", b"user", b"agentenv-$marker", b"secret-$marker", 14, -4)  # -4: user keyring
print("add_key:", r, err)
if r > 0:
    print("ESCAPED stored a key that outlives the sandbox")
r, err = sys_call("keyctl", 0, -4, 0)  # KEYCTL_GET_KEYRING_ID of the user keyring
print("keyctl:", r, err)
""", then=_SYSCALLS + """
r, err = sys_call("keyctl", 10, -4, b"user", b"agentenv-$marker", 0)  # KEYCTL_SEARCH the user keyring
print("second sandbox keyctl search:", r, err)
if r > 0:
    print("ESCAPED a later sandbox found the earlier one's key")
r, err = sys_call("request_key", b"user", b"agentenv-$marker", 0, 0)
if r > 0:
    print("ESCAPED request_key found the earlier sandbox's key")
"""),
    Attack("ptrace_sibling", "no process can trace or read the memory of another (ptrace, process_vm_readv)", """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:
    time.sleep(30)
    os._exit(0)
for name, req in (("PTRACE_ATTACH", 16), ("PTRACE_SEIZE", 0x4206)):
    if libc.ptrace(req, pid, 0, 0) == 0:
        print("ESCAPED", name, "of a sibling process")
    else:
        print("blocked", name, os.strerror(ctypes.get_errno()))
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(64)
local, remote = iovec(ctypes.cast(buf, ctypes.c_void_p), 64), iovec(0x400000, 64)
if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) > 0:
    print("ESCAPED process_vm_readv of a sibling")
else:
    print("blocked process_vm_readv", os.strerror(ctypes.get_errno()))
if libc.ptrace(16, $bystander_pid, 0, 0) == 0:
    print("ESCAPED PTRACE_ATTACH of a host process")
os.kill(pid, signal.SIGKILL)
"""),
    Attack("tiocsti", "no typing into a terminal (TIOCSTI), no controlling tty", """
import fcntl, os, termios
try:
    fd = os.open("/dev/tty", os.O_RDWR)
    print("ESCAPED opened a controlling tty")
    fcntl.ioctl(fd, termios.TIOCSTI, b"x")
    print("ESCAPED TIOCSTI into the controlling tty")
except OSError as e:
    print("blocked /dev/tty", e)
for fd in (0, 1, 2):
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b"x")
        print("ESCAPED TIOCSTI on fd", fd)
    except OSError as e:
        print("blocked TIOCSTI on fd", fd, e.strerror)
try:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSTI, b"x")
    print("ESCAPED TIOCSTI allowed at all (even on a pty of its own)")
except OSError as e:
    print("blocked TIOCSTI on its own pty", e.strerror)
"""),
    Attack("abstract_unix", "no connection to the host's abstract unix sockets", """
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\\0$abstract_name")
    print("ESCAPED connected to the host's abstract socket")
except OSError as e:
    print("blocked", e)
""", host_check=_no_abstract_connection),
    Attack("dev_shm_fill", "/dev/shm and /dev cannot be filled (no uncapped tmpfs)", """
total = 0
chunk = bytes(1 << 20)
for d in ("/dev/shm", "/dev", "/dev/pts"):
    n = 0
    try:
        while total < ($disk_mb + $memory_mb + 64) << 20:
            with open("%s/fill%d" % (d, n), "wb") as f:  # many files, each under the file-size limit
                for _ in range($max_file_mb - 1):
                    f.write(chunk)
                    total += 1 << 20
            n += 1
    except OSError as e:
        print("blocked", d, e.strerror, "after", total >> 20, "MB")
if total > ($disk_mb + 8) << 20:
    print("ESCAPED wrote", total >> 20, "MB outside the capped /tmp")
"""),
    Attack("fd_exhaustion", "open files are capped (RLIMIT_NOFILE: 15,000 fds)", """
import os
fds = []
try:
    while len(fds) < 15000:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print("stopped at", len(fds), "open files:", e.strerror)
if len(fds) >= 15000:
    print("ESCAPED opened", len(fds), "files")
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


def judge(sandbox, attack: Attack, target: Target, base: Limits = LIMITS) -> Verdict:
    limits = base.replace(**attack.limits)
    marker = f"{313 + secrets.randbelow(600)}.{secrets.randbelow(10**6)}"  # a unique `sleep` duration
    meter = _LagMeter()
    meter.start()
    try:
        r = sandbox.run(target.code(attack, limits, marker), limits)
        if attack.then is not None:  # a fresh sandbox: what can it still see of the first one?
            r2 = sandbox.run(target.code(attack, limits, marker, attack.then), limits)
            r.stdout += r2.stdout
            r.stderr += r2.stderr
            if not r2.stdout.startswith("RAN uid="):
                r.stdout += "SECOND RUN DID NOT RUN\n"
    finally:
        meter.stop.set()
        meter.join()
    problems = ["the second sandbox did not run"] if "SECOND RUN DID NOT RUN" in r.stdout else []
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
