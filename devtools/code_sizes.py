"""The largest modules and functions of a checkout, in lines, for notes on a code's shape.

    python -m devtools.code_sizes [--root DIR] [--top N] [--over LINES] [FOLDER ...]

Counts the Python files under the given folders (default: the shipped ones) of `--root`
(default: this checkout; a `git worktree` of an older commit gives the figures before a
change). A module's size is its line count; a function's is the span of its `def` to its
last line (decorators excluded, nested functions counted in their own right as well).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Iterator, NamedTuple

SHIPPED = ("pdpool", "engine", "kernels", "sidecar", "operator")


class Sized(NamedTuple):
    lines: int
    name: str


def python_files(root: Path, folders: list[str]) -> Iterator[Path]:
    for folder in folders:
        base = root / folder
        if base.is_file():
            yield base
        else:
            yield from sorted(base.rglob("*.py"))


def functions(source: str, rel: str) -> Iterator[Sized]:
    tree = ast.parse(source, filename=rel)

    def walk(node: ast.AST, prefix: str) -> Iterator[Sized]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.lineno
                yield Sized(end - child.lineno + 1, f"{rel}:{child.lineno} {name}")
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def measure(root: Path, folders: list[str]) -> tuple[list[Sized], list[Sized]]:
    modules, funcs = [], []
    for path in python_files(root, folders):
        rel = str(path.relative_to(root))
        source = path.read_text()
        modules.append(Sized(len(source.splitlines()), rel))
        funcs.extend(functions(source, rel))
    return sorted(modules, reverse=True), sorted(funcs, reverse=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="*", default=list(SHIPPED))
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--top", type=int, default=10, help="rows of each table")
    p.add_argument("--over", type=int, default=60, help="also list every function this long")
    args = p.parse_args()
    folders = [f for f in args.folders if (args.root / f).exists()]
    modules, funcs = measure(args.root, folders)
    print(f"{len(modules)} modules, {sum(m.lines for m in modules)} lines in {' '.join(folders)}")
    print("\nlargest modules (lines)")
    for m in modules[: args.top]:
        print(f"{m.lines:6d}  {m.name}")
    print("\nlargest functions (lines)")
    for f in funcs[: args.top]:
        print(f"{f.lines:6d}  {f.name}")
    long = [f for f in funcs if f.lines > args.over]
    print(f"\nfunctions over {args.over} lines: {len(long)}")
    for f in long:
        print(f"{f.lines:6d}  {f.name}")


if __name__ == "__main__":
    main()
