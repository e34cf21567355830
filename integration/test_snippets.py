"""The Python snippets of README.md and docs/*.md, read from the markdown (never copied) and run as
printed, on gloo: the docs cannot drift from the code (``testing/snippets.py`` says how blocks are
marked, ``testing/snippet_runs.py`` what each snippet is given and must do).

Two launches for all of them: one of 2 ranks runs the 2-rank snippets in sequence, then one of 1
rank, in the same folder, resumes the tour's 2-rank checkpoint and runs the single-process ones.
Without a launch: every python block is marked, every marked snippet is run, every substitution
still applies, every link between the pages resolves, every ``shardckpt COMMAND --option`` the
pages show exists, every pipeline they show parses, and the README's layer table is the one
``tests/test_layers.py`` holds.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import pytest

from testing.ranks import run_ranks
from testing.snippet_runs import PHASES, RANK_PHASE, SINGLE_PHASE, SKIPPED, job
from testing.snippets import ROOT, all_blocks, command_mentions, doc_paths

pytestmark = pytest.mark.slow

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_python_block_is_marked_runnable_or_illustration() -> None:
    unmarked = [f"{b.path}:{b.line}" for b in all_blocks() if not b.kind]
    assert not unmarked, ("python blocks with neither <!-- snippet: NAME ... --> nor "
                          f"<!-- illustration: ... --> on the line before the fence: {unmarked}")


def test_every_marked_snippet_is_run_and_every_run_snippet_is_marked() -> None:
    names = [b.name for b in all_blocks() if b.kind == "snippet"]
    assert len(names) == len(set(names)), f"snippet names used twice: {sorted(names)}"
    run = {r.name for phase in PHASES.values() for r in phase}
    assert not run - set(names), f"snippets the test runs, missing from the docs: {sorted(run - set(names))}"
    assert not set(names) - run, f"marked snippets no test runs: {sorted(set(names) - run)}"


def test_substitutions_apply_and_the_results_compile() -> None:
    for b in all_blocks():
        if b.kind == "snippet":
            compile(b.runnable(), f"{b.path}:{b.line}", "exec")


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_links_between_the_pages_resolve() -> None:
    broken = []
    for page in [*doc_paths(), ROOT / "SECURITY.md"]:
        for target in _LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_readme_layer_table_is_test_layers_order() -> None:
    tree = ast.parse((ROOT / "tests" / "test_layers.py").read_text())
    layers = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "LAYERS" for t in n.targets))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| layer | holds |"):].split("\n\n")[0]
    rows = re.findall(r"^\| `(?:shardckpt/)?([a-z_]+)(?:\.py|/)` \|", table, flags=re.M)
    assert [r for r in rows if r != "testing"] == layers


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    work: Path = tmp_path_factory.mktemp("snippets")
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    skip = {}
    if importlib.util.find_spec("torchtitan") is None:  # as integration/test_torchtitan.py does
        if os.environ.get("SHARDCKPT_REQUIRE_TORCHTITAN") == "1":
            raise RuntimeError("SHARDCKPT_REQUIRE_TORCHTITAN=1 but torchtitan is not installed "
                               "(.ci/run installs it: pip install --no-deps torchtitan==0.3.0)")
        skip["torchtitan-config"] = "torchtitan is not installed (.ci/run installs it)"
    ranks = run_ranks(job, 2, args=(str(work), "ranks", skip), timeout_s=600, pg_timeout_s=120, env=env)
    single = run_ranks(job, 1, args=(str(work), "single", skip), timeout_s=300, pg_timeout_s=120, env=env)
    return {"ranks": ranks, "single": single}


def _assert_ran(results: list, name: str) -> None:
    for r in results:
        assert r.ok, r.describe()
        if r.value[name].startswith(SKIPPED):
            pytest.skip(r.value[name].removeprefix(SKIPPED))
        assert r.value[name] == "", f"rank {r.rank}, snippet {name}: {r.value[name]}"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", [r.name for r in RANK_PHASE])
def test_snippet_runs_on_two_ranks(outcomes: dict[str, list], name: str) -> None:
    _assert_ran(outcomes["ranks"], name)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", [r.name for r in SINGLE_PHASE])
def test_snippet_runs_on_one_rank_after_them(outcomes: dict[str, list], name: str) -> None:
    _assert_ran(outcomes["single"], name)


def test_commands_and_options_in_the_docs_exist() -> None:
    """Every ``shardckpt COMMAND --option`` the pages show is in that command's ``--help``, and
    every command line of a shell block names a command (an inline span without options may be
    prose: `shardckpt manifest signature v1`)."""
    import subprocess
    import sys

    helps: dict[tuple[str, ...], str] = {}
    missing = []
    for where, words, flags, in_shell in command_mentions():
        for sub in (words[1].split("|") if len(words) > 1 else [None]):
            key = (*words[:1], sub) if sub else words
            if key not in helps:
                run = subprocess.run([sys.executable, "-m", "shardckpt", *key, "--help"],
                                     capture_output=True, text=True, cwd=ROOT,
                                     env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1"})
                helps[key] = run.stdout if run.returncode == 0 else ""
            if not helps[key]:
                if in_shell or flags:
                    missing.append(f"{where}: shardckpt {' '.join(key)} is no command")
                continue
            missing += [f"{where}: shardckpt {' '.join(key)} has no {f}" for f in flags
                        if not re.search(rf"(?<![\w-]){f}(?![\w-])", helps[key])]
    assert not missing, "\n".join(missing)


def test_pipelines_in_the_docs_parse() -> None:
    """Every ```toml block of the pages is a pipeline `shardckpt watch` accepts."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    from shardckpt.watch.config import parse_pipeline

    found = 0
    for page in doc_paths():
        for n, block in enumerate(re.findall(r"^```toml\n(.*?)^```", page.read_text(encoding="utf-8"),
                                             flags=re.M | re.S)):
            parse_pipeline(tomllib.loads(block), f"{page.name} toml block {n + 1}")
            found += 1
    assert found >= 2, "the README's tour and docs/pipelines.md each show a pipeline"
