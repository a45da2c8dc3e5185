"""The package's shape: no import cycle (function-level imports included), no two rooms (folders and
top-level modules of src/headlab) importing each other, no private name imported across modules, no logic
in __init__.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from headlab.config import GROUPS
from headlab.studies import registry

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "headlab"


def _module_name(path: Path) -> str:
    parts = ["headlab", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the module, at any depth."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("headlab")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("headlab"):
                out.append((target, [a.name for a in node.names], node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the headlab modules it imports; `from pkg import sub` counts as importing pkg.sub."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, names, _ in _imports(name):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            others = [n for n in names if f"{target}.{n}" not in MODULES]
            graph[name].update(subs)
            if (others or not names) and target in MODULES:
                graph[name].add(target)
    # the study and task registries import the modules of their package by name (importlib) and use those
    # that hold a study or a task, which no import statement shows
    for room, marker in (("studies", "STUDY = Study("), ("tasks", "(Task):")):
        registry_module = f"headlab.{room}.registry"
        graph[registry_module].update(
            n
            for n in MODULES
            if n.startswith(f"headlab.{room}.") and n != registry_module and marker in MODULES[n].read_text()
        )
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_function_level_imports_and_finds_a_planted_cycle():
    graph = _graph()
    assert "headlab.studies.execute_run" not in graph["headlab.cli"]  # a name, not a module
    assert "headlab.studies" in graph["headlab.cli"]  # `from .studies import execute_run`, inside a function
    assert all(s.run.__module__ in MODULES for s in registry.builtin())  # every built-in study is a module
    assert "headlab.api" in graph["headlab"]
    planted = {k: set(v) for k, v in graph.items()}
    planted["headlab.errors"].add("headlab.api")  # api -> config -> errors -> api
    assert any("headlab.errors" in c and "headlab.api" in c for c in _cycles(planted))


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def _room(module: str) -> str | None:
    """headlab.analysis.sinks -> analysis, headlab.results -> results; None for the package itself,
    whose __init__ re-exports from every room."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _ties(graph: dict[str, set[str]]) -> list[str]:
    """'A <-> B (a module -> b module, b module -> a module)' for every two rooms that import each other."""
    first: dict[tuple[str, str], tuple[str, str]] = {}  # (room, room it imports) -> one such import
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = _room(name), _room(target)
            if a and b and a != b:
                first.setdefault((a, b), (name, target))
    return [
        f"{a} <-> {b} ({' -> '.join(first[a, b])}, {' -> '.join(first[b, a])})"
        for a, b in sorted(first)
        if a < b and (b, a) in first
    ]


def test_the_room_walker_finds_a_planted_two_way_tie():
    graph = {k: set(v) for k, v in _graph().items()}
    assert "headlab.interventions.sinks" in graph["headlab.analysis.sinks"]
    graph["headlab.interventions.edits"].add("headlab.analysis.sinks")  # the tie sink detection once made
    assert _ties(graph) == [
        "analysis <-> interventions (headlab.analysis.heads -> headlab.interventions, "
        "headlab.interventions.edits -> headlab.analysis.sinks)"
    ]


def test_no_two_rooms_import_each_other():
    assert _ties(_graph()) == []


def test_no_private_name_imported_across_modules():
    private = [
        f"{name}:{line} imports {n} from {target}"
        for name in MODULES
        for target, names, line in _imports(name)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert private == []


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _is_package(n)))
def test_init_files_hold_no_logic(name):
    """A package's __init__.py: a docstring, imports (re-exports) and __version__ / __all__ only."""
    tree = ast.parse(MODULES[name].read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id in ("__version__", "__all__") for t in node.targets
        ):
            continue
        pytest.fail(f"{MODULES[name]}:{node.lineno}: {type(node).__name__} in an __init__.py")


def test_the_door_names_no_study_and_no_module_is_imported_for_its_side_effect():
    """Short forms come from the studies' records; each room's options reach the door through config.ROOMS,
    so no module imports another only to fill a table (an import a linter calls unused)."""
    door = MODULES["headlab.door"].read_text()
    groups = set(GROUPS)  # `headlab train` and `headlab sae` run studies named after their config groups
    named = [s for s in set(registry.studies()) - groups if f'"{s}"' in door or f"'{s}'" in door]
    assert named == []
    unused = [f"{name}:{n + 1}" for name in MODULES for n, line in enumerate(MODULES[name].read_text().splitlines())
              if "noqa: F401" in line and not _is_package(name)]  # fmt: skip
    assert unused == []


def test_parts_are_found_by_what_their_modules_declare():
    """Tasks, studies, SAE architectures and figure sets: a module of the kind's package declares its part
    by one module-level name, and the registry holds exactly those (discovery.declared / declaring)."""
    from headlab.figures import FIGURES
    from headlab.sae.registry import builtin as saes
    from headlab.tasks.registry import builtin as tasks

    def declaring(package: str, name: str) -> set[str]:
        folder = PACKAGE / package
        return {
            p.stem
            for p in folder.glob("*.py")
            for node in ast.parse(p.read_text()).body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
        }

    assert set(FIGURES) == declaring("figures", "FIGURE_SET") and "ioi_diagram" not in FIGURES
    assert {cls.__module__.rsplit(".", 1)[1] for cls in saes().values()} == declaring("sae", "SAE") != set()
    assert {cls.__module__.rsplit(".", 1)[1] for cls in tasks().values()} == declaring("tasks", "TASK")
    assert {s.run.__module__.rsplit(".", 1)[1] for s in registry.builtin()} == declaring("studies", "STUDY")
