"""What a sandboxed call may use (:class:`Limits`) and what it did (:class:`ExecResult`).

Contract:

* ``Limits`` is immutable and validated on construction; every backend enforces every field (how, per backend, is
  documented in that backend's module). ``timeout_s`` is wall-clock and always kills the whole process tree;
  ``cpu_s``, ``memory_mb`` (address space, per process), ``max_processes``, ``max_file_mb`` (largest single file)
  and ``max_open_files`` are kernel rlimits (a backend with a cgroup also caps the whole tree's memory, shared
  memory and tmpfs included, at ``memory_mb``, and its task count); ``disk_mb`` is the size of the private
  writable ``/tmp``; ``max_output_bytes`` caps stdout and stderr separately, while reading, and marks the cut
  with :data:`TRUNCATION_MARKER`.
* ``ExecResult`` is a plain record: decoded stdout/stderr (UTF-8, invalid bytes replaced), the exit code in shell
  convention (``128 + N`` when killed by signal N, on every backend), one flag per limit that was hit, and wall time.
  ``ok`` means exit 0 and no limit hit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TRUNCATION_MARKER = "\n[agentenv sandbox: output truncated, {dropped} more bytes dropped]\n"


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 65536
    max_file_mb: int = 16
    disk_mb: int = 64
    max_open_files: int = 1024

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"Limits.{name} must be a positive number of seconds, got {v!r}")
        floors = {"memory_mb": 32, "max_processes": 1, "max_output_bytes": 1, "max_file_mb": 1, "disk_mb": 1,
                  "max_open_files": 16}
        for name, floor in floors.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < floor:
                raise ValueError(f"Limits.{name} must be an int >= {floor}, got {v!r}")

    def replace(self, **changes) -> Limits:
        return dataclasses.replace(self, **changes)


@dataclass
class ExecResult:
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    memory_exceeded: bool = False
    cpu_exceeded: bool = False
    output_truncated: bool = False
    wall_time_s: float = 0.0
    session_restarted: bool = False  # a session call killed the interpreter: all state from earlier calls is gone
    backend: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (
            self.timed_out or self.memory_exceeded or self.cpu_exceeded or self.output_truncated)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok}
