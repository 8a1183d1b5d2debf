"""The import map of a package, from its source (nothing is imported or run): circles and arrows that run back up.

A room is a top-level module (`forge/loop.py`) or a subpackage (`forge/rewards/`, all its files together); an arrow
A -> B means a file of A imports a file of B (any `import`/`from` anywhere in the file: at the top, in a function,
under TYPE_CHECKING; `from pkg import mod` is an arrow to the module, not to the package). Rooms that import each other, directly or around a loop, form a strongly connected component;
every arrow inside one runs back up (no floor order can place both ends), so "arrows that run back up" is the number
of room-to-room arrows inside such components, and a floor is 1 + the highest floor a room imports (loops
collapsed). File-level circles are the same computation with one room per file.

Usage: python scripts/import_map.py [PACKAGE_DIR] [--files]   (default: forge)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that `path` (module `name`) imports, anywhere in the file."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import mod` imports the module; `from pkg import name` the package (its __init__)
            targets = [t for t in subs if t in modules] or [base]
            targets += [base] if any(t not in modules for t in subs) else []
        for t in targets:
            while t and t not in modules:  # `from forge.data import x` -> forge.data (its __init__)
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(comp)
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return out


def floors(graph: dict[str, set[str]], comps: list[set[str]]) -> dict[str, int]:
    comp_of = {n: i for i, c in enumerate(comps) for n in c}
    key = lambda n: comp_of.get(n, n)  # noqa: E731
    memo: dict = {}

    def floor(k) -> int:
        if k not in memo:
            memo[k] = 0
            members = comps[k] if isinstance(k, int) else {k}
            below = {key(m) for n in members for m in graph[n]} - {k}
            memo[k] = 1 + max((floor(b) for b in below), default=0)
        return memo[k]

    return {n: floor(key(n)) for n in graph}


def room_of(module: str, top: str, files: bool) -> str:
    parts = module.split(".")
    if files or len(parts) <= 2:
        return module
    return f"{parts[0]}.{parts[1]}/"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package", nargs="?", default="forge", type=Path)
    ap.add_argument("--files", action="store_true", help="one room per file (file-level circles)")
    args = ap.parse_args()
    root = args.package.resolve()
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        room = room_of(name, root.name, args.files)
        graph.setdefault(room, set())
        graph[room] |= {room_of(m, root.name, args.files) for m in imports_of(path, name, set(paths))} - {room}
    comps = components(graph)
    back = sorted((a, b) for c in comps for a in c for b in graph[a] if b in c)
    level = floors(graph, comps)
    arrows = sum(len(v) for v in graph.values())
    print(f"{root.name}: {len(graph)} rooms ({'files' if args.files else 'files and subpackages'}), {arrows} arrows, "
          f"{max(level.values(), default=0)} floors, {len(comps)} circles, {len(back)} arrows that run back up")  # fmt: skip
    for i, c in enumerate(comps, 1):
        print(f"circle {i}: {', '.join(sorted(c))}")
    for a, b in back:
        print(f"  back up: {a} -> {b}")


if __name__ == "__main__":
    sys.exit(main())
