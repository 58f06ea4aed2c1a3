"""The catalogue of real hostile programs that ``agentenv sandbox check`` and the security tests run.

Each :class:`~agentenv.sandboxes.attack_kit.Attack` names the guarantee it tests; :func:`judge` (from
:mod:`.attack_kit`) decides whether a sandbox contained it. :data:`ATTACKS` is every attack, this module's and
:mod:`.attacks_kernel`'s (the kernel surface and the session boundary).
"""

from __future__ import annotations

from agentenv.sandboxes.attack_kit import (LIMITS, MARGIN_S, Attack, Target, Verdict, _bystander_alive, _capped,
                                           _exited_fast, _flag, _no_abstract_connection, _no_connection,
                                           _nothing_written, judge, leftovers)
from agentenv.sandboxes.attacks_kernel import KERNEL_ATTACKS

__all__ = ["ATTACKS", "LIMITS", "MARGIN_S", "Attack", "Target", "Verdict", "judge", "leftovers"]


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


ATTACKS: list[Attack] = [
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
    Attack("ptrace_sibling", "no tracing at all (ptrace, process_vm_readv), not even of its own child", """
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
ATTACKS += KERNEL_ATTACKS
