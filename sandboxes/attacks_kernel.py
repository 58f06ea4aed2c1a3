"""Attacks on the kernel surface and on the session's cell boundary (part of :data:`.attacks.ATTACKS`).

What they pin down, precisely:

* socket families are an allowlist (AF_UNIX, AF_INET, AF_INET6): AF_VSOCK, which network namespaces do not
  isolate, AF_PACKET and AF_NETLINK cannot even be opened;
* the machine-wide Linux AIO pool cannot be reserved (``io_setup`` is denied);
* host configuration kept under ``/usr`` (``/usr/local/etc``, ``/usr/etc``) is not mounted;
* no process can read the memory of a host process, nor of a process of another sandbox (invisible in its PID
  namespace) nor of a sandbox's root-owned init (bubblewrap's), through ``/proc/<pid>/mem``; a process *may*
  read the memory of its own sandbox's processes of its uid there (its children, docker's init), as anywhere on
  Linux: one sandbox is one trust domain;
* a sandbox cannot lock a file of the shared read-only ``/usr`` against other sandboxes or the host (``flock`` is
  denied; an exclusive POSIX lock needs write access);
* a session call ends only when its cell has: a forged end-of-cell marker does not end it early, and nothing a
  cell leaves behind -- a signal handler on a timer, a thread, a child -- gets CPU between two calls.

Session attacks print ``BEAT <time.monotonic()>`` whenever they compute (see :mod:`.attack_kit`). Every loop is
bounded in time, and the only network touched is the sandbox's own loopback.
"""

from __future__ import annotations

from agentenv.sandboxes.attack_kit import Attack

KERNEL_ATTACKS = [
    Attack("socket_families", "only AF_UNIX/AF_INET/AF_INET6 sockets (no AF_VSOCK, AF_PACKET, AF_NETLINK)", """
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
for name, family, kind in (("AF_VSOCK", 40, 1), ("AF_PACKET", 17, 3), ("AF_NETLINK", 16, 3), ("AF_BLUETOOTH", 31, 1),
                           ("AF_VSOCK|1<<32", 40 | 1 << 32, 1)):
    fd = libc.syscall(41, ctypes.c_long(family), kind, 0)  # socket(2) itself: no libc or Python checks
    if fd >= 0:
        print("ESCAPED opened an", name, "socket")
    else:
        print("blocked", name, errno.errorcode.get(ctypes.get_errno()))
try:
    v = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    v.settimeout(1)
    v.connect((2, 1024))  # VMADDR_CID_HOST
    print("ESCAPED connected to the host over vsock")
except OSError as e:
    print("blocked vsock", e)
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
c = socket.create_connection(s.getsockname(), timeout=1)
a, _ = s.accept()
c.sendall(b"x")
print("loopback still works:", a.recv(1) == b"x")
""", expect=lambda r, lim: None if r.exit_code == 0 and "loopback still works: True" in r.stdout
      else "AF_INET on loopback no longer works"),
    Attack("aio_pool", "the machine-wide AIO pool cannot be reserved (io_setup denied)", """
import ctypes, errno, platform
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 206, "aarch64": 0}[platform.machine()]
got = 0
for _ in range(64):
    ctx = ctypes.c_ulong(0)
    if libc.syscall(nr, 65536, ctypes.byref(ctx)) != 0:
        print("blocked io_setup", errno.errorcode.get(ctypes.get_errno()))
        break
    got += 65536
if got:
    print("ESCAPED reserved", got, "AIO events")
"""),
    Attack("usr_host_config", "host configuration under /usr (/usr/local/etc, /usr/etc) is invisible", """
import os
for d in ("/usr/local/etc", "/usr/local", "/usr/etc"):
    try:
        print("ESCAPED listed", d, os.listdir(d)[:5])
    except OSError as e:
        print("blocked", d, type(e).__name__)
"""),
    Attack("proc_mem", "no reading another sandbox's or a host process's memory via /proc/<pid>/mem", """
import os
for pid in ($bystander_pid, 1):
    try:
        with open("/proc/%d/status" % pid) as st:
            uid = int([line for line in st if line.startswith("Uid:")][0].split()[1])
        if uid == os.getuid():  # this sandbox's own init (docker's runs as our uid): one trust domain
            print("skipped pid", pid, "of this sandbox's own uid")
            continue
        with open("/proc/%d/maps" % pid) as m:
            start = int(m.readline().split("-")[0], 16)
        with open("/proc/%d/mem" % pid, "rb") as f:
            f.seek(start)
            print("ESCAPED read the memory of pid", pid, f.read(8))
    except (OSError, ValueError) as e:
        print("blocked", pid, type(e).__name__)
"""),
    Attack("usr_lock", "no exclusive lock on a shared /usr file, so none blocks another sandbox (flock denied)", """
import errno, fcntl, os, sys
fd = os.open(os.path.realpath(sys.executable), os.O_RDONLY)
for name, take in (("flock", lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)),
                   ("lockf", lambda: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))):
    try:
        take()
        print("ESCAPED took an exclusive", name, "lock on", sys.executable)
    except OSError as e:
        print("blocked", name, errno.errorcode.get(e.errno))
"""),
    Attack("forged_marker", "a session call ends only when its cell has (a forged end-of-cell marker)", """
import os, resource, sys, time
tag = b"\\0\\x1eAE" + sys._getframe(1).f_locals["nonce"]  # the runner's own nonce, from its frame
os.write(2, tag + b"\\0")  # the stderr marker too, for a backend that waits for both (docker)
os.write(1, tag + b":0:\\0")
resource.setrlimit(resource.RLIMIT_CPU, (100, resource.RLIM_INFINITY))
end = time.monotonic() + 0.6
while time.monotonic() < end:
    print("BEAT", time.monotonic(), flush=True)
    t = time.monotonic() + 0.02
    while time.monotonic() < t:
        pass
print("CELL DONE")
""", session=True),
    Attack("alarm_between_cells", "no CPU between session cells for a signal handler on a timer", """
import signal, time
def beat(*_):
    print("BEAT", time.monotonic(), flush=True)
    t = time.monotonic() + 0.01
    while time.monotonic() < t:
        pass
signal.signal(signal.SIGALRM, beat)
signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
""", then="import signal\nsignal.setitimer(signal.ITIMER_REAL, 0)\n", session=True),
    Attack("threads_between_cells", "no CPU between session cells for a thread or a child a cell left running", """
import os, threading, time
def beat():
    end = time.monotonic() + 4
    while time.monotonic() < end:
        print("BEAT", time.monotonic(), flush=True)
        t = time.monotonic() + 0.05
        while time.monotonic() < t:
            pass
threading.Thread(target=beat, daemon=True).start()
if os.fork() == 0:
    beat()
    os._exit(0)
""", session=True),
]
