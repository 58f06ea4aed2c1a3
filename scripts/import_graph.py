"""Print the import graph of agentenv's packages (module-level AND function-level imports), its layers and cycles.

``python scripts/import_graph.py [trainer]`` prints the layer order, then ``module -> imports`` for every module (or
only those under the given top-level folder), and exits 1 if any cycle exists or a layer imports one above it. It
also lists every module over 420 lines and function over 80 in the four packages (``SIZE:``; the test holds them
to a short list of known ones).
tests/test_import_graph.py runs the same checks.

The layers, lowest first (a module may import its own layer and those below, never above):
core <- sandboxes <- envs <- samplers <- trainer <- run <- cli.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"agentenv": "agentenv", "trainer": "agentenv.trainer", "envs": "agentenv.envs",
            "sandboxes": "agentenv.sandboxes", "configs": "agentenv.configs"}


# `agentenv` (the root __init__, which only registers the envs) and `configs` (YAML data) sit outside the layers.
LAYERS = ["agentenv.core", "agentenv.sandboxes", "agentenv.envs", "agentenv.samplers", "agentenv.trainer",
          "agentenv.run", "agentenv.cli"]


def modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        base = ROOT / folder
        # agentenv/ holds the layer sub-packages; the other top-level folders are installed as their own packages
        for p in sorted(base.rglob("*.py") if folder == "agentenv" else base.glob("*.py")):
            parts = [pkg, *p.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def layer(module: str) -> int | None:
    """Index of the module's layer in LAYERS (None outside them)."""
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            return i
    return None


def layer_violations(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a lower layer imports a higher one."""
    out = []
    for m, deps in g.items():
        lm = layer(m)
        for d in deps:
            ld = layer(d)
            if lm is not None and ld is not None and ld > lm:
                out.append((m, d))
    return sorted(out)


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    pkg = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import submodule` depends on the submodule; `from pkg import name` on pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not (t == "agentenv" and name.startswith("agentenv.")):
                deps.add(t)  # (`import agentenv` from inside it only registers the envs: its root loads first anyway)
    return deps


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 420, 80
SIZED = ("agentenv", "trainer", "envs", "sandboxes")  # the four packages the size rules cover


def size_violations() -> list[str]:
    """``path`` for each module over MAX_MODULE_LINES and ``path:function`` for each function (method, nested
    function) over MAX_FUNCTION_LINES, each with its size: ``"envs/x.py (512 lines)"``."""
    out = []
    for folder in SIZED:
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel, text = p.relative_to(ROOT).as_posix(), p.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                out.append(f"{rel} ({len(text.splitlines())} lines)")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        out.append(f"{rel}:{node.name} ({n} lines)")
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    g = graph()
    print("layers: " + " <- ".join(name.removeprefix("agentenv.") for name in LAYERS))
    only = PACKAGES.get(sys.argv[1]) if len(sys.argv) > 1 else None
    for m in sorted(g):
        if only is None or m.startswith(only + ".") or m == only:
            short = sorted(d.replace(only + ".", "") if only else d for d in g[m] if only is None or d.startswith(only))
            print(f"{m.replace((only or '') + '.', '') if only else m:28s} -> {', '.join(short) or '-'}")
    found = cycles(g)
    for c in found:
        print("CYCLE:", " <-> ".join(c))
    upward = layer_violations(g)
    for m, d in upward:
        print(f"LAYER: {m} imports {d}, a layer above it")
    sizes = size_violations()
    for v in sizes:
        print(f"SIZE: {v} (limits: {MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a function)")
    sys.exit(1 if found or upward else 0)
