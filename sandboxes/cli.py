"""``agentenv sandbox run|check``: run one file sandboxed, or prove the backend's isolation on this machine.

``add_subcommands(subparsers)`` adds ``sandbox`` to an argparse sub-parser set; each leaf sets ``func`` to its
handler, which takes the parsed args and returns the process exit status. ``main(argv)`` is the stand-alone entry
(``python -m agentenv.sandboxes.cli ...``).

* ``sandbox run [--backend B] [--timeout S] [--memory-mb M] [--require-isolation] FILE.py`` prints exactly one
  JSON object on stdout:
  :meth:`ExecResult.to_dict` (stdout, stderr, exit_code, the limit flags, wall_time_s, ok). Exit status 0 whenever
  the file was run (whatever it did), 2 for bad input or an unusable backend.
* ``sandbox check [--backend B] [--json]`` runs every attack of :mod:`agentenv.sandboxes.attacks` and lists, per
  guarantee, whether it held. Exit status 0 only if every attack was contained. It refuses to attack the host
  through the ``subprocess`` backend, which by design guarantees nothing but limits.
"""

from __future__ import annotations

import argparse
import json
import sys

from agentenv.sandboxes import BACKENDS, Limits, backend_status, make_sandbox


def add_subcommands(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sandbox", help="run Python in a sandbox, or check the sandbox's isolation here")
    sub = p.add_subparsers(dest="sandbox_command", metavar="{run,check}", required=True)
    r = sub.add_parser("run", help="run FILE.py in a fresh sandbox and print the result as one JSON object")
    r.add_argument("--backend", default="bubblewrap", choices=BACKENDS)
    r.add_argument("--timeout", type=float, default=Limits.timeout_s, metavar="S", help="wall-clock seconds")
    r.add_argument("--memory-mb", type=int, default=Limits.memory_mb, metavar="M",
                   help="memory: address space per process, and the whole sandbox's where it has a cgroup")
    r.add_argument("--require-isolation", action="store_true",
                   help="refuse to run unless namespaces, seccomp and cgroups are all active")
    r.add_argument("file", metavar="FILE.py")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("check", help="attack the sandbox with hostile code and list which guarantees hold")
    c.add_argument("--backend", default="bubblewrap", choices=BACKENDS)
    c.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    c.set_defaults(func=cmd_check)
    return p


def _fail(msg: str) -> int:
    print(f"agentenv sandbox: {msg}", file=sys.stderr)
    return 2


def cmd_run(args) -> int:
    try:
        with open(args.file, encoding="utf-8") as f:
            code = f.read()
    except (OSError, UnicodeDecodeError) as e:
        return _fail(f"cannot read {args.file}: {e}")
    try:
        limits = Limits(timeout_s=args.timeout, cpu_s=args.timeout, memory_mb=args.memory_mb)
        sandbox = make_sandbox(args.backend, limits=limits, require_isolation=args.require_isolation)
    except (ValueError, RuntimeError) as e:
        return _fail(str(e))
    with sandbox:
        result = sandbox.run(code)
    print(json.dumps(result.to_dict()))
    return 0


def cmd_check(args) -> int:
    from agentenv.sandboxes.attacks import ATTACKS, LIMITS, Target, judge

    if args.backend == "subprocess":
        print("subprocess backend: NO isolation guarantee holds (same user, filesystem, network and processes as "
              "the host); only the resource limits apply. Not attacking the host to prove it.")
        return 1
    try:
        sandbox = make_sandbox(args.backend, limits=LIMITS)
    except (ValueError, RuntimeError) as e:
        others = {k: v for k, v in backend_status().items() if k != args.backend}
        return _fail(f"{e}\nother backends: {json.dumps(others)}")
    target = Target()
    verdicts = []
    try:
        with sandbox:
            for attack in ATTACKS:
                v = judge(sandbox, attack, target)
                verdicts.append(v)
                if not args.json:
                    mark = "held  " if v.contained else "BROKEN"
                    print(f"[{mark}] {attack.guarantee}  ({attack.name}, {v.result.wall_time_s:.2f}s)"
                          + "".join(f"\n          - {p}" for p in v.problems), flush=True)
    finally:
        target.close()
    held = sum(v.contained for v in verdicts)
    worst_lag = max(v.host_lag_s for v in verdicts)
    if args.json:
        print(json.dumps({"backend": args.backend, "attacks": len(verdicts), "contained": held,
                          "host_worst_lag_s": worst_lag,
                          "results": [{"attack": v.attack.name, "guarantee": v.attack.guarantee,
                                       "contained": v.contained, "problems": v.problems,
                                       "wall_time_s": v.result.wall_time_s} for v in verdicts]}))
    else:
        print(f"{args.backend}: {len(verdicts)} attacks, {held} contained; host stayed responsive "
              f"(worst scheduling lag {worst_lag * 1000:.0f} ms)")
    return 0 if held == len(verdicts) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentenv")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
