"""The Python snippets of README.md and docs/*.md, read from the markdown and run as printed.

Every ```python block is marked by an HTML comment on the line before its fence (readers of the
rendered page do not see it):

* ``<!-- snippet: NAME | clause | OLD => NEW | ... -->``: runnable. Clauses without ``=>`` say,
  for readers of the source, where it runs and what it is given (``ranks 2``, ``given: model``,
  ``after tour-loop``); ``OLD => NEW`` is a text substitution the test makes before running it
  (sizes down to a tiny model, a URL to a local folder), and OLD must occur in the block, so a
  snippet edited past its marker fails instead of running something else;
* ``<!-- illustration: why -->``: shown, not run (the outline of a class, a table entry).

:mod:`testing.snippet_runs` says what each runnable snippet is given and must do, and runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MARK = re.compile(r"^<!--\s*(snippet|illustration):\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    """One fenced python block: where it is, its marker (kind '' if none) and its code."""

    path: str
    line: int          # 1-based line of the opening fence
    kind: str          # "snippet", "illustration" or ""
    name: str
    subs: tuple[tuple[str, str], ...]
    code: str

    def runnable(self) -> str:
        """The code with every substitution made; ValueError if one no longer applies."""
        code = self.code
        for old, new in self.subs:
            if old not in code:
                raise ValueError(f"{self.path}:{self.line}: snippet {self.name!r}: {old!r} "
                                 f"(to be replaced by {new!r}) is not in the block")
            code = code.replace(old, new)
        return code


def doc_paths(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def python_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """Every python block of one markdown file, with the marker on the line before its fence."""
    lines = path.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3), i
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        if lang in ("python", "py", "python3"):
            mark = _MARK.match(lines[start - 1]) if start else None
            kind, name, subs = "", "", ()
            if mark:
                kind = mark.group(1)
                parts = [p.strip() for p in mark.group(2).split(" | ")]
                name = parts[0] if kind == "snippet" else ""
                subs = tuple(tuple(p.split(" => ", 1)) for p in parts[1:] if " => " in p)  # type: ignore[misc]
            out.append(Block(str(path.relative_to(root)), start + 1, kind, name, subs,
                             "\n".join(lines[start + 1:i]) + "\n"))
        i += 1
    return out


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in doc_paths(root) for b in python_blocks(p, root)]


def snippet(name: str, root: Path = ROOT) -> Block:
    found = [b for b in all_blocks(root) if b.kind == "snippet" and b.name == name]
    if len(found) != 1:
        raise LookupError(f"snippet {name!r}: {len(found)} marked blocks in the docs, expected 1")
    return found[0]


# ------------------------------------------------------------------ commands named in the docs

_SPAN = re.compile(r"`(shardckpt [^`]+)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def command_mentions(root: Path = ROOT) -> list[tuple[str, tuple[str, ...], tuple[str, ...], bool]]:
    """(where, command words, long options, from a shell block) of every ``shardckpt ...`` the
    docs show: inline code spans and the lines of shell blocks (``torchrun ... -m shardckpt ...``
    included)."""
    out = []
    for path in doc_paths(root):
        text = path.read_text(encoding="utf-8")
        found = [(m.group(1), text.count("\n", 0, m.start()) + 1, False) for m in _SPAN.finditer(text)]
        shell = False
        for n, line in enumerate(text.split("\n"), 1):
            if line.startswith("```"):
                shell = line.strip() in ("```bash", "```sh") if not shell else False
            elif shell and re.search(r"(^|-m )shardckpt ", line):
                found.append((line[line.index("shardckpt "):].split("#")[0], n, True))
        for cmd, n, in_shell in found:
            words = cmd.replace("\\|", "|").split()
            path_words = [words[1]] if words[1:] and not words[1].startswith("-") else []
            if path_words and path_words[0] in ("import", "export") and len(words) > 2:
                every = "hf|deepspeed|dcp" if path_words[0] == "import" else "deepspeed|dcp"
                path_words.append(every if words[2] in ("...", "…") else words[2])
            out.append((f"{path.relative_to(root)}:{n}", tuple(path_words), tuple(_FLAG.findall(cmd)),
                        in_shell))
    return out
