"""The seccomp filter every bubblewrap sandbox runs under: deny the syscalls tool code never needs.

Built with libseccomp (its Python binding ``seccomp`` from Debian's ``python3-seccomp``, or ``pyseccomp`` from
PyPI, the same API over ctypes) and handed to bubblewrap as compiled BPF (``--seccomp FD``); bubblewrap installs it
just before it executes the sandboxed command, so it binds that command and everything it starts.

Contract:

* Default action ALLOW; every rule below answers ``EPERM`` (``ENOSYS`` for ``clone3``, whose flags live in memory a
  filter cannot read, so libc falls back to ``clone``, whose flags it can). The syscall is not run at all.
* Denied (Docker's default profile, for a container without ``CAP_SYS_ADMIN``, plus the issue's list):
  new namespaces of any kind (``unshare``; ``clone`` with a ``CLONE_NEW*`` flag; ``setns``) -- so no nested user
  namespace and no capability set inside one; every mount call (old and new API, ``pivot_root``, ``chroot``);
  the kernel keyring (``keyctl``, ``add_key``, ``request_key``: it is not namespaced by our PID/IPC namespaces);
  process inspection (``ptrace``, ``process_vm_readv/writev``, ``kcmp``, ``pidfd_getfd``); ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring_*``; module loading, ``kexec_*``, ``reboot``, swap, clocks,
  quotas, ``acct``, ``syslog``, NUMA placement, file handles; ``personality`` with flags that weaken ASLR or
  exec protections (which also denies the 0xffffffff query, unused by Python); ``ioctl(TIOCSTI)`` /
  ``ioctl(TIOCLINUX)`` (typing into a terminal); Linux AIO (``io_setup`` and the rest: its pool is
  machine-wide).
* ``flock`` fails with ``ENOLCK`` (no locks available): a BSD lock needs no write access, so on the read-only
  ``/usr`` inodes every sandbox shares, one sandbox's exclusive lock would block (or signal to) another's. POSIX
  record locks (``fcntl``/``lockf``, what sqlite uses) stay: an exclusive one needs a file open for writing,
  which ``/usr`` never is here, and shared ones never block anyone (another sandbox can still *see* one with
  ``F_GETLK``: a signal between two cooperating sandboxes, not interference with a third).
* Sockets by allowlist: ``socket``/``socketpair`` succeed only for AF_UNIX, AF_INET and AF_INET6; every other
  family (AF_VSOCK, which network namespaces do not cover, AF_PACKET, AF_NETLINK, ...) fails with
  ``EAFNOSUPPORT``. Python starts and serves loopback without netlink.
* Non-native ABIs (x32, i386 on x86_64) are killed by libseccomp's architecture check.
* :func:`bpf` returns the compiled program (cached per process); :data:`UNAVAILABLE` says why there is none.
* :func:`docker_profile` states the same rules as a Docker seccomp profile (JSON, no library needed), so both
  backends deny the same calls.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

UNAVAILABLE: str | None = None

DENY = (
    # namespaces, mounts, root changes
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr",
    # kernel keyring
    "keyctl", "add_key", "request_key",
    # looking into or controlling other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # large kernel attack surfaces tool code does not need
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # Linux AIO: io_setup reserves from the machine-wide aio-max-nr pool, so one sandbox could take all of it
    "io_setup", "io_submit", "io_cancel", "io_destroy", "io_getevents", "io_pgetevents",
    "lookup_dcookie", "fanotify_init", "open_by_handle_at", "name_to_handle_at",
    # the machine itself
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "syslog", "quotactl", "quotactl_fd",
    "settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm", "vhangup",
    "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vm86", "vm86old",
    # NUMA placement (Docker: needs CAP_SYS_NICE)
    "mbind", "set_mempolicy", "get_mempolicy", "move_pages", "migrate_pages",
)
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
PERSONALITY_FLAGS = (0x0040000, 0x0100000, 0x0200000, 0x0400000, 0x0800000, 0x8000000)
# ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, ADDR_COMPAT_LAYOUT, READ_IMPLIES_EXEC, ADDR_LIMIT_32BIT, ADDR_LIMIT_3GB
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# socket()/socketpair() families: only AF_UNIX (1), AF_INET (2) and AF_INET6 (10); the rest (AF_VSOCK, which
# ignores network namespaces, AF_PACKET, AF_NETLINK, ...) fail with EAFNOSUPPORT. Stated as denials (0, 3..9,
# above 10) because the filter's default is ALLOW; a negative or oversized family compares as above 10.
SOCKET_FAMILIES = (1, 2, 10)
DENIED_FAMILIES = (0, *range(3, 10))


def _library():
    try:
        import seccomp as lib  # Debian's python3-seccomp (libseccomp's own binding)
    except ImportError:
        try:
            import pyseccomp as lib  # PyPI: the same API over ctypes
        except (ImportError, OSError) as e:
            raise ImportError("neither `seccomp` (apt-get install python3-seccomp) nor `pyseccomp` (pip install "
                              f"pyseccomp) is importable: {e}") from None
    return lib


def build_filter():
    """The libseccomp filter object (see the module docstring for what it denies)."""
    lib = _library()
    f = lib.SyscallFilter(lib.ALLOW)
    eperm = lib.ERRNO(errno.EPERM)
    for name in DENY:
        try:
            f.add_rule(eperm, name)
        except (ValueError, RuntimeError, OSError):
            pass  # not a syscall on this architecture (e.g. vm86 on x86_64)
    f.add_rule(lib.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NEW_FLAGS:
        f.add_rule(eperm, "clone", lib.Arg(0, lib.MASKED_EQ, flag, flag))
    for flag in PERSONALITY_FLAGS:
        f.add_rule(eperm, "personality", lib.Arg(0, lib.MASKED_EQ, flag, flag))
    for request in (TIOCSTI, TIOCLINUX):
        f.add_rule(eperm, "ioctl", lib.Arg(1, lib.MASKED_EQ, 0xFFFFFFFF, request))
    f.add_rule(lib.ERRNO(errno.ENOLCK), "flock")
    no_family = lib.ERRNO(errno.EAFNOSUPPORT)
    for call in ("socket", "socketpair"):
        for family in DENIED_FAMILIES:
            f.add_rule(no_family, call, lib.Arg(0, lib.EQ, family))
        f.add_rule(no_family, call, lib.Arg(0, lib.GT, max(SOCKET_FAMILIES)))
    return f


@functools.lru_cache(maxsize=1)
def _compiled(pid: int) -> bytes | None:
    global UNAVAILABLE
    try:
        f = build_filter()
    except (ImportError, OSError, RuntimeError, ValueError) as e:
        UNAVAILABLE = f"{type(e).__name__}: {e}"
        return None
    with tempfile.TemporaryFile() as tmp:
        f.export_bpf(tmp)
        tmp.seek(0)
        return tmp.read()


def bpf() -> bytes | None:
    """The compiled BPF program (a multiple of 8 bytes), or None with the reason in :data:`UNAVAILABLE`."""
    return _compiled(os.getpid())


def program_fd(program: bytes) -> int:
    """A readable fd positioned at the start of ``program`` (a memfd; the caller closes it after the spawn)."""
    fd = os.memfd_create("agentenv-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def docker_profile() -> dict:
    """The same rules in Docker's seccomp profile format (``security_opt=["seccomp=" + json.dumps(...)]``)."""
    rules = [{"names": list(DENY), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
             {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS}]
    for name, index, flags in (("clone", 0, CLONE_NEW_FLAGS), ("personality", 0, PERSONALITY_FLAGS)):
        rules += [{"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                   "args": [{"index": index, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ"}]} for f in flags]
    rules += [{"names": ["ioctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
               "args": [{"index": 1, "value": 0xFFFFFFFF, "valueTwo": request, "op": "SCMP_CMP_MASKED_EQ"}]}
              for request in (TIOCSTI, TIOCLINUX)]
    rules += [{"names": ["flock"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOLCK}]
    rules += [{"names": ["socket", "socketpair"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EAFNOSUPPORT,
               "args": [{"index": 0, "value": v, "op": op}]}
              for v, op in [*((f, "SCMP_CMP_EQ") for f in DENIED_FAMILIES),
                            (max(SOCKET_FAMILIES), "SCMP_CMP_GT")]]
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}
