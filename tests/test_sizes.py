"""The size budget, enforced: no library file (``shardckpt/``, ``cli/``) over 400 lines and no
function over 80 (every ``def``: module functions, methods and nested functions alike, counted from
the ``def`` line to the function's last line).

A file that outgrows the budget is split by responsibility, not trimmed. Any exception is named
below with its reason; there are none.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("shardckpt", "cli")

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

#: Files allowed over the budget for good, each with its reason (path relative to the repo root).
FILE_EXCEPTIONS: dict[str, str] = {}
#: Functions allowed over the budget for good ("path::qualified.name" -> reason).
FUNCTION_EXCEPTIONS: dict[str, str] = {}



def _library_files() -> list[Path]:
    return sorted(p for top in LIBRARY for p in (ROOT / top).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _functions(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function in the source, nested ones included."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _over_budget_functions(path: Path) -> list[tuple[str, int, int]]:
    return [f for f in _functions(path.read_text()) if f[2] > MAX_FUNCTION_LINES]


def test_no_library_file_over_budget() -> None:
    over = [f"{_rel(p)}: {n} lines" for p in _library_files()
            if (n := _lines(p)) > MAX_FILE_LINES and _rel(p) not in FILE_EXCEPTIONS]
    assert not over, (f"over {MAX_FILE_LINES} lines; split by responsibility into well-named "
                      "modules:\n" + "\n".join(over))


def test_no_function_over_budget() -> None:
    over = []
    for path in _library_files():
        for name, line, n in _over_budget_functions(path):
            if f"{_rel(path)}::{name}" not in FUNCTION_EXCEPTIONS:
                over.append(f"{_rel(path)}:{line} {name}: {n} lines")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(over)


def test_no_stale_exemptions() -> None:
    """Every exemption names a file that exists; a permanent one, a file (or function) that is
    still over the budget."""
    stale = [f"{rel}: no such file" for rel in sorted(FILE_EXCEPTIONS)
             if not (ROOT / rel).is_file()]
    stale += [f"{rel}: within budget now" for rel in sorted(FILE_EXCEPTIONS)
              if (ROOT / rel).is_file() and _lines(ROOT / rel) <= MAX_FILE_LINES]
    for key in sorted(FUNCTION_EXCEPTIONS):
        rel, _, name = key.partition("::")
        path = ROOT / rel
        if not path.is_file() or name not in {f[0] for f in _over_budget_functions(path)}:
            stale.append(f"{key}: no such function over {MAX_FUNCTION_LINES} lines")
    assert not stale, "remove these exemptions:\n" + "\n".join(stale)


def test_functions_are_measured_from_def_to_last_line() -> None:
    """The measure itself: methods and nested functions count, each on its own; classes do not."""
    src = ("class A:\n"
           "    def m(self):\n"
           "        def inner():\n"
           "            return 1\n"
           "        return inner\n"
           "async def f():\n"
           "    pass\n")
    assert _functions(src) == [("A.m", 2, 4), ("A.m.inner", 3, 2), ("f", 6, 2)]
