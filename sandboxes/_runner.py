"""The program that runs INSIDE every sandbox (``python3 -S -I -c <this source> MODE AS CPU NPROC FSIZE NOFILE``).

Contract with the host (:mod:`agentenv.sandboxes.channel`):

* First it lowers its own rlimits (address space, CPU, processes, file size, open files, no core dumps) before any
  untrusted code runs; lowered hard limits cannot be raised again by an unprivileged uid, and none is ever asked
  above the hard limit it inherited (a container's may be lower than the one requested). In a session the CPU soft
  limit is re-armed per cell (``used + cpu_s``) and the hard limit stays open (an unprivileged uid could not raise
  it again for the next cell), so a cell can raise its soft limit: the bound that cannot be undone is the host's,
  which meters the whole tree's CPU through its cgroup (:class:`.channel.CpuBudget`) besides the wall timeout, and
  a call ends only once the host has proved this runner back at its read (:mod:`agentenv.sandboxes.boundary`).
* It resets SIGINT to the default action, so the interpreter catches no signal at all: a caught signal is a
  handler the cell installed, which tells the host to freeze the tree between cells.
* Cells arrive on stdin as ``b"<nbytes> <nonce> <cpu_s>\\n" + source``. stdin is then pointed at /dev/null so user
  code that reads input gets EOF instead of the protocol.
* User code runs in a fresh ``__main__`` module; its output goes straight to the real fd 1/2 (stdout line-buffered,
  so a cell killed by the wall timeout still shows what it printed).
* MODE ``once``: run one cell like ``python file.py`` (exit status, ``SystemExit`` and an uncaught exception's
  traceback as there), then, from an ``atexit`` handler registered before the cell ran (so after the cell's own
  handlers and its non-daemon threads), write the end marker below. The host ends the run at that marker and
  kills the tree, without waiting for the interpreter's teardown; a run that exits without it (``os._exit``, a
  signal) ends at the exit.
* MODE ``session``: run cells forever like notebook cells: a trailing expression is echoed via ``sys.displayhook``
  (like the REPL), ``SystemExit`` ends only the cell. After each cell it writes
  ``\\0\\x1eAE<nonce>:<exit code>:<ExcName>\\0`` to stdout (the exception's name tells MemoryError apart). Over
  pipes that one marker suffices: whatever this thread wrote to stderr before is already in the stderr pipe, so
  the host drains it without waiting. MODES
  ``once-mux`` and ``session-mux`` (Docker, where both streams are re-multiplexed and may be reordered) also
  write ``\\0\\x1eAE<nonce>\\0`` to stderr first, and the host waits for both.

Only builtin modules (``posix``, not ``os``) and ``resource`` are imported up front: under ``-S`` a bare
interpreter never imports ``os``, and a fresh sandbox should not pay for it unless the cell does.
"""
import posix as os
import sys


def _end(tag, ended, mux, out, err, write=os.write):
    """Flush what the cell printed, then mark the end of the cell (see the module docstring). ``write`` is bound
    here, before any cell runs: a cell that replaces ``posix.write`` does not reach it."""
    for stream in (sys.stdout, sys.stderr) if sys.stdout is out and sys.stderr is err else (
            sys.stdout, sys.stderr, out, err):
        try:
            stream.flush()
        except BaseException:
            pass
    code, exc_name = ended
    try:
        if mux:
            write(2, tag + b"\0")
        write(1, tag + b":%d:%s\0" % (code, exc_name.encode()))
    except OSError:  # the cell closed fd 1 or 2: the host ends the call at the exit instead
        pass


def _show_traceback(exc, source, filename):
    import linecache
    import traceback
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop this runner's own frame
    traceback.print_exception(type(exc), exc, tb)


def _main(argv):
    import _ast
    import _signal
    import resource as r

    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)

    mode, as_bytes, cpu, nproc, fsize, nofile = argv[0], *map(int, argv[1:6])
    once, mux = mode.startswith("once"), mode.endswith("-mux")
    def cap(res, v):  # never above the hard limit we were given (a container's may be lower): that would raise
        hard = r.getrlimit(res)[1]
        v = v if hard == r.RLIM_INFINITY else min(v, hard)
        r.setrlimit(res, (v, v))

    cap(r.RLIMIT_CORE, 0)
    cap(r.RLIMIT_FSIZE, fsize)
    cap(r.RLIMIT_NOFILE, nofile)
    cap(r.RLIMIT_NPROC, nproc)
    cap(r.RLIMIT_AS, as_bytes)
    r.setrlimit(r.RLIMIT_CPU, (cpu, cpu + 1) if once else (cpu, r.RLIM_INFINITY))

    ctl = open(os.dup(0), "rb")  # dup() is close-on-exec: user subprocesses never see the protocol
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True)
    out, err = sys.stdout, sys.stderr
    main = type(sys)("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["<cell>"]
    cells = armed = 0

    while True:
        head = ctl.readline()
        if not head:
            os._exit(0)
        n, nonce, cell_cpu = head.split()
        tag, ended = b"\0\x1eAE" + nonce, [1, ""]
        source = ctl.read(int(n)).decode("utf-8", "replace")
        cells += 1
        filename = "<cell>" if once else f"<cell-{cells}>"
        if not once:
            used = r.getrusage(r.RUSAGE_SELF)
            soft = int(used.ru_utime + used.ru_stime) + int(cell_cpu)
            if soft != armed:  # same whole second of use as last cell: the armed limit is already right
                r.setrlimit(r.RLIMIT_CPU, (soft, r.RLIM_INFINITY))
                armed = soft
        code, exc_name = 0, ""
        if once:  # registered before the cell runs: after its own handlers and its non-daemon threads; not in a fork
            import atexit
            atexit.register(lambda pid=os.getpid(): os.getpid() == pid and _end(tag, ended, mux, out, err))
        try:
            tree = compile(source, filename, "exec", _ast.PyCF_ONLY_AST)
            last = None
            if not once and tree.body and isinstance(tree.body[-1], _ast.Expr):
                last = _ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), main.__dict__)
            if last is not None:
                sys.displayhook(eval(compile(last, filename, "eval"), main.__dict__))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException as e:
            code, exc_name = 1, type(e).__name__
            try:
                _show_traceback(e, source, filename)
            except BaseException:  # e.g. MemoryError again while formatting: keep the name, lose the text
                pass
        ended[:] = [code & 0xFF if once else code, exc_name]  # what a process's exit status keeps of it
        if once:
            sys.exit(code)
        _end(tag, ended, mux, out, err)


_main(sys.argv[1:])
