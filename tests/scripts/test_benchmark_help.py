"""Every benchmark script's ``--help`` explains every option (the standard the product CLI's
``test_every_option_has_help`` holds): each ``add_argument`` call in ``benchmarks/**/*.py`` (the tuning
sweeps in ``benchmarks/tune/`` too) passes ``help=``. Read from the source, since several scripts need a GPU
(or Triton) to import."""

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parents[2] / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_benchmark_option_has_help(path):
    missing = [
        f"line {node.lineno}: {ast.unparse(node.args[0]) if node.args else '?'}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("add_argument", "add_subparsers")
        and not any(k.arg == "help" for k in node.keywords)
    ]
    assert not missing, f"{path.name}: options without help: {missing}"


def test_the_scripts_are_found():
    assert len(BENCHMARKS) > 10
    assert len([p for p in BENCHMARKS if p.parent.name == "tune"]) == 9  # the tuning sweeps
