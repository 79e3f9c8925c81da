"""The package's import graph, read from the source (every ``import``, at module level or inside a function;
``if TYPE_CHECKING:`` blocks left out, they never run): no circle between modules, and every arrow between
two subpackages goes down the layers docs/design.md states -- formats < kernels < layers < models < quantize,
engine < eval, bench < server < cli -- and so does every arrow between two of the engine's rooms (its
sub-packages): device < request < reference < runner, loading < spec < loop < front. A new module that imports
upward fails here with the arrow."""

from __future__ import annotations

import ast
import pathlib

import pytest

import fp4moe

ROOT = pathlib.Path(fp4moe.__file__).parent
# each subpackage's layer: a module may import from a lower layer or its own subpackage, never from a higher
# layer or from another subpackage of its own layer (quantize and engine know nothing of each other)
LAYERS = {
    "__init__": 0,
    "errors": 0,
    "data": 1,
    "formats": 1,
    "kernels": 2,
    "layers": 3,
    "models": 4,
    "quantize": 5,
    "engine": 5,
    "eval": 6,
    "bench": 6,
    "server": 7,
    "cli": 8,
    "__main__": 9,  # python -m fp4moe: the command
}


# the engine's rooms, by the same rule one level down (runner and loading know nothing of each other)
ENGINE_ROOMS = {
    "__init__": 0,
    "device": 1,
    "request": 2,
    "reference": 3,
    "runner": 4,
    "loading": 4,
    "spec": 5,
    "loop": 6,
    "front": 7,
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The package's modules that ``name`` imports when it runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _room(module: str) -> str:
    """The engine room (sub-package) of an engine module: ``fp4moe.engine.loop.core`` -> ``loop``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_every_subpackage_has_a_layer():
    assert {_subpackage(m) for m in _modules()} == set(LAYERS)


def test_every_engine_module_is_in_a_room():
    assert {_room(m) for m in _modules() if _subpackage(m) == "engine"} == set(ENGINE_ROOMS)


def _upward(graph, level_of, where) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if where(a) != where(b) and level_of[where(a)] <= level_of[where(b)]
    )


def test_no_import_runs_up_the_layers():
    upward = _upward(_graph(), LAYERS, _subpackage)
    assert not upward, "imports that run up (or across) the layers:\n" + "\n".join(upward)


def test_no_import_runs_up_the_engines_rooms():
    engine = {
        a: {b for b in t if _subpackage(b) == "engine"}
        for a, t in _graph().items()
        if _subpackage(a) == "engine"
    }
    upward = _upward(engine, ENGINE_ROOMS, _room)
    assert not upward, "engine imports that run up (or across) its rooms:\n" + "\n".join(upward)


def _room_graph() -> dict[str, set[str]]:
    """The rooms' own graph: an arrow from room a to room b where a module of a imports one of b."""
    rooms: dict[str, set[str]] = {r: set() for r in ENGINE_ROOMS}
    for a, targets in _graph().items():
        if _subpackage(a) == "engine":
            rooms[_room(a)].update(
                _room(b) for b in targets if _subpackage(b) == "engine" and _room(b) != _room(a)
            )
    return rooms


def test_the_engines_rooms_form_no_circle():
    _no_circle(_room_graph(), "room circle")


def test_no_import_circle():
    _no_circle(_graph(), "import circle")


def _no_circle(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt) :] + [nxt]
                pytest.fail(f"{what}: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_check_sees_an_upward_arrow_and_a_circle(tmp_path, monkeypatch):
    """The checks above can fail: a formats module importing the engine, two modules importing each other."""
    pkg = tmp_path / "fp4moe"
    for sub in ("formats", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "formats" / "a.py").write_text("from fp4moe.engine import b\n")
    (pkg / "engine" / "b.py").write_text("def f():\n    from fp4moe.formats.a import x\n")
    monkeypatch.setattr(f"{__name__}.ROOT", pkg)
    graph = _graph()
    assert graph["fp4moe.formats.a"] == {"fp4moe.engine", "fp4moe.engine.b"}
    assert graph["fp4moe.engine.b"] == {"fp4moe.formats.a"}
    with pytest.raises(AssertionError, match="fp4moe.formats.a -> fp4moe.engine.b"):
        test_no_import_runs_up_the_layers()
    with pytest.raises(pytest.fail.Exception, match="import circle"):
        test_no_import_circle()


def test_the_check_sees_an_upward_arrow_between_rooms(tmp_path, monkeypatch):
    """The rooms' checks can fail: the loop importing a front, and the front importing the loop back."""
    pkg = tmp_path / "fp4moe"
    for sub in ("engine", "engine/loop", "engine/front"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "loop" / "core.py").write_text(
        "def f():\n    from fp4moe.engine.front.llm import LLM\n"
    )
    (pkg / "engine" / "front" / "llm.py").write_text("from fp4moe.engine.loop.core import EngineCore\n")
    monkeypatch.setattr(f"{__name__}.ROOT", pkg)
    with pytest.raises(AssertionError, match="fp4moe.engine.loop.core -> fp4moe.engine.front.llm"):
        test_no_import_runs_up_the_engines_rooms()
    with pytest.raises(
        pytest.fail.Exception, match="room circle: front -> loop -> front|room circle: loop -> front -> loop"
    ):
        test_the_engines_rooms_form_no_circle()
