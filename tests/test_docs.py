"""Every command in README.md and docs/ is kept honest, with no model loaded: each `headlab ...` line of a
fenced block is parsed as the CLI parses it and its config composed and validated through the door;
`list` and `--help` lines run; Python blocks run on the demo's toy model unless a `<!-- not run: why -->`
line stands right above them; every repository path named in backticks exists.
"""

from __future__ import annotations

import re
import shlex
import sys
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import headlab
from conftest import run_headlab

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<info>[^\n`]*)$")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
PASS_THROUGH = ("run", "train", "sae", "atlas", "check", "plan")
PLACEHOLDER = "..."  # "and the rest of your overrides", as a command line in prose writes it


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@dataclass
class Block:
    page: Path
    line: int  # 1-based, of the fence
    lang: str
    text: str
    not_run: str | None  # why the block is not run, where the page says so


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown page (indented ones, in lists, too), each dedented."""
    lines = (page.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        indent, fence = start["indent"], start["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence)}[ \t]*$", lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        above = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        marked = NOT_RUN.search(above)
        lang = start["info"].split()[0].lower() if start["info"].split() else ""
        found.append(Block(page, i + 1, lang, "\n".join(body), marked[1] if marked else None))
        i = j + 1
    return found


@dataclass(frozen=True)
class Command:
    where: str
    args: tuple[str, ...]  # after `headlab`

    def __str__(self) -> str:
        return f"{self.where}: headlab {' '.join(self.args)}"


def commands(page: Path, text: str | None = None) -> list[Command]:
    """Each `headlab ...` line of every fenced block (a `\\` continues it; `# ...` ends it)."""
    found = []
    for block in blocks(page, text):
        if block.lang in ("python", "py", "yaml", "json", "csv"):
            continue
        logical: list[tuple[int, str]] = []
        pending = ""
        for n, raw in enumerate(block.text.splitlines()):
            pending += raw.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            logical.append((n, pending))
            pending = ""
        for n, line in logical:
            words = shlex.split(line, comments=True)
            while words and (words[0] in ("$", "sudo") or "=" in words[0] and not words[0].startswith("-")):
                words = words[1:]  # a prompt, or VAR=value before the command
            if not words or Path(words[0]).name != "headlab":
                continue
            where = f"{page.relative_to(ROOT)}:{block.line + 1 + n}"
            found.append(Command(where, tuple(w for w in words[1:] if w != PLACEHOLDER)))
    return found + table_commands(page, text)


def table_commands(page: Path, text: str | None = None) -> list[Command]:
    """The `headlab ...` code spans of table rows ("I want to ... -> command"), outside fenced blocks;
    a span with a <placeholder> or an ellipsis stands for a family of commands and is left out."""
    lines = (page.read_text() if text is None else text).splitlines()
    fenced = {n for b in blocks(page, text) for n in range(b.line - 1, b.line + b.text.count("\n") + 2)}
    found = []
    for n, line in enumerate(lines):
        if n in fenced or not line.lstrip().startswith("|"):
            continue
        for span in re.findall(r"`(headlab [^`]+)`", line):
            if "<" not in span and PLACEHOLDER not in span:
                found.append(Command(f"{page.relative_to(ROOT)}:{n + 1}", tuple(shlex.split(span)[1:])))
    return found


@cache
def cli_group():
    import typer

    from headlab.cli import app

    return typer.main.get_command(app)


def validate(command: Command) -> None:
    """Parse the line as `headlab` does and compose each config it would run, through the door; nothing
    is trained, loaded or written. Raises the error a user would see."""
    from headlab import door, reproduce
    from headlab.studies.registry import named_study, study_for

    if not command.args or command.args[0] in ("--help", "-h"):
        return
    name, *args = command.args
    group = cli_group()
    if name not in group.commands:
        raise headlab.UsageError(f"no such command '{name}'")
    try:
        with group.commands[name].make_context(name, list(args)) as ctx:
            params, extra = dict(ctx.params), list(ctx.args)
    except Exception as e:  # the CLI's own usage errors (typer's click), as the command line shows them
        if not hasattr(e, "format_message"):
            raise
        raise headlab.UsageError(f"headlab {name}: {e.format_message()}") from None
    if name in PASS_THROUGH:
        overrides = list(extra)
        if name == "atlas":
            overrides = ["study=atlas", *overrides]
            if params.get("scores"):
                overrides.append(f"++study.scores=[{params['scores']}]")
        run_as = "run" if name in ("atlas", "check", "plan") else name
        if params.get("multirun"):
            door.validate_overrides(
                overrides, lambda cfg, chosen: study_for(run_as, cfg, named_study(door.expand_short_forms(chosen)))
            )
        else:
            _, cfg = door.compose_checked(overrides, hydra_config=True, device=False)
            if name not in ("check",):
                study_for(run_as, cfg, named_study(door.expand_short_forms(overrides)))
    elif name == "audit":  # the run dir's own overrides come from its files; the rest compose as a run's
        _, cfg = door.compose_checked(["study=audit", *extra], hydra_config=True, device=False)
        study_for("run", cfg, named_study(["study=audit"]))
    elif name == "reproduce" and params.get("name"):
        chosen = reproduce.get(params["name"])
        model, extra_overrides = reproduce.model_override(tuple(params.get("overrides") or ()))
        first = chosen.runs(bool(params.get("quick")), model)[0]
        door.compose_checked([*first, "output.root=outputs", *extra_overrides], device=False)


def runs_as_is(command: Command) -> bool:
    """`list` and `--help` lines run: they are quick and write nothing."""
    return command.args[:1] == ("list",) or "--help" in command.args or command.args[-1:] == ("--list",)


ALL = [c for page in pages() for c in commands(page)]


def test_the_docs_hold_commands_to_check():
    assert len(ALL) > 40
    assert any(c.where.startswith("README.md") for c in ALL)


@pytest.mark.parametrize("command", ALL, ids=str)
def test_each_command_composes_at_the_door(command, tmp_path):
    if runs_as_is(command):
        result = run_headlab(*command.args, cwd=tmp_path)
        assert result.returncode == 0, f"{command}\n{result.stderr}"
        assert result.stdout.strip()
        return
    try:
        validate(command)
    except Exception as e:
        pytest.fail(f"{command}\n{type(e).__name__}: {e}")


def test_a_wrong_option_planted_in_a_docs_page_is_caught():
    page = DOCS / "guides" / "ablation-patching.md"
    planted = page.read_text() + "\n```bash\nheadlab run ablate=heads ablate.methd=mean\n```\n"
    wrong = commands(page, planted)[-1]
    with pytest.raises(headlab.UsageError, match="methd"):
        validate(wrong)
    unknown = commands(page, page.read_text() + "\n```bash\nheadlab run task=iio\n```\n")[-1]
    with pytest.raises(headlab.UsageError, match="unknown task 'iio'"):
        validate(unknown)
    bad_flag = commands(page, page.read_text() + "\n```bash\nheadlab reuse a b --k many\n```\n")[-1]
    with pytest.raises(headlab.UsageError, match="--k"):
        validate(bad_flag)


# ---------------------------------------------------------------- Python blocks


PYTHON = [(page, [b for b in blocks(page) if b.lang in ("python", "py")]) for page in pages()]
PYTHON = [(page, found) for page, found in PYTHON if found]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, demo_root):
    """A directory whose outputs/ is the session's demo root: `load_model("toy-attn-1l")` reuses its model."""
    here = tmp_path_factory.mktemp("docs-python")
    (here / "outputs").symlink_to(demo_root, target_is_directory=True)
    return here


@pytest.mark.parametrize(
    "page, found", PYTHON, ids=[str(p.relative_to(ROOT)) for p, _ in PYTHON]
)  # fmt: skip
def test_python_blocks_run_on_the_toy_model(page, found, workdir, monkeypatch):
    """A page's Python blocks run in order in one namespace, which starts with the toy model of the demo
    (`model`), its task (`task`, 32 prompts) and a head sweep's table (`table`)."""
    from headlab.sae import registry as saes
    from headlab.studies import registry as studies
    from headlab.tasks import registry as tasks

    monkeypatch.chdir(workdir)
    for registry, name in ((saes, "ARCHITECTURES"), (studies, "REGISTERED"), (tasks, "REGISTERED")):
        monkeypatch.setattr(registry, name, dict(getattr(registry, name)))  # what a page registers goes with it
    model = headlab.load_model("toy-attn-1l")
    task = headlab.load_task("counting", n_prompts=32)
    module = types.ModuleType("docs_page")  # a module of its own: dataclasses look their class's module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    scope = module.__dict__
    scope.update(headlab=headlab, model=model, task=task)
    scope["table"] = headlab.sweep(model, task, ablate="heads", n_boot=0)
    ran = 0
    for block in found:
        if block.not_run:
            continue
        try:
            exec(compile(block.text, f"{page.relative_to(ROOT)}:{block.line}", "exec"), scope)
        except Exception as e:
            pytest.fail(f"{page.relative_to(ROOT)}:{block.line}: {type(e).__name__}: {e}")
        ran += 1
    assert ran or all(b.not_run for b in found)


def test_every_python_block_left_unrun_says_why():
    for page, found in PYTHON:
        for block in found:
            assert block.not_run is None or len(block.not_run) > 10, f"{page}:{block.line}: say why it is not run"


# ---------------------------------------------------------------- paths


# a path named in backticks: a file or directory of the repository (src/headlab's own folders count,
# as the docs name them: `models/families.py` is src/headlab/models/families.py)
PATH = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?)`")
TOP = {p.name for p in ROOT.iterdir()} | {p.name for p in (ROOT / "src" / "headlab").iterdir()}
WRITTEN = ("outputs", "site")  # what commands write, not what the repository holds


def named_paths(page: Path) -> list[str]:
    text = re.sub(r"(?ms)^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", "", page.read_text())  # prose, not blocks
    found = []
    for name in PATH.findall(text):
        first = name.split("/")[0]
        is_file = re.search(r"\.(py|yaml|yml|ipynb|md|txt|json|png|csv|sh|toml|js|cfg)$", name)
        if first in WRITTEN or ("/" not in name and not (is_file and name.endswith((".py", ".sh", ".ipynb")))):
            continue
        if "/" in name and first not in TOP:
            continue
        found.append(name)
    return found


def exists(name: str) -> bool:
    if "/" not in name:  # a module named alone: somewhere in the sources, tests or benchmarks
        return any(ROOT.glob(f"src/**/{name}")) or any(ROOT.glob(f"*/{name}"))
    return any((base / name).exists() for base in (ROOT, ROOT / "src" / "headlab", ROOT / "src"))


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_named_in_backticks_exists(page):
    missing = [name for name in named_paths(page) if not exists(name)]
    assert missing == [], f"{page.relative_to(ROOT)} names paths that are not there: {missing}"


def test_the_path_check_catches_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See `src/headlab/no_such_module.py`, `models/families.py` and `outputs/runs/`.\n")
    assert [n for n in named_paths(page) if not exists(n)] == ["src/headlab/no_such_module.py"]
