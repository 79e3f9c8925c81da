"""The package's import graph, read from the source (every ``import``, at module level or inside a function;
``if TYPE_CHECKING:`` blocks left out, they never run): no circle between modules, and every arrow between
two subpackages goes down the layers docs/design.md states -- formats < kernels < layers < models <
quantize, engine < eval, bench < server < cli. A new module that imports upward fails here with the arrow."""

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


def test_every_subpackage_has_a_layer():
    assert {_subpackage(m) for m in _modules()} == set(LAYERS)


def test_no_import_runs_up_the_layers():
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in targets
        if _subpackage(a) != _subpackage(b) and LAYERS[_subpackage(a)] <= LAYERS[_subpackage(b)]
    )
    assert not upward, "imports that run up (or across) the layers:\n" + "\n".join(upward)


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
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
