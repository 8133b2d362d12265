"""The shape a maintainer can hold in their head: no module of gpusnap over
500 lines, no function over 80 (generated protobuf code aside). One that must
be over for a while is listed with its size and may only shrink: a listed
one that shrinks lowers its entry, or leaves the list once within the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "gpusnap"
MODULE_LINES, FUNCTION_LINES = 500, 80
# Over the rule (none today): the most each may have, while it is split.
MODULES_OVER: dict[str, int] = {}
FUNCTIONS_OVER: dict[str, int] = {}


def _sources() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if not p.name.endswith("_pb2.py")
            and not p.name.endswith("_pb2_grpc.py")]


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    modules, functions = {}, {}
    for path in _sources():
        name = str(path.relative_to(ROOT))
        text = path.read_text()
        modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{name}:{node.name}"] = max(
                    functions.get(f"{name}:{node.name}", 0), node.end_lineno - node.lineno + 1)
    return modules, functions


def _check(sizes: dict[str, int], limit: int, allowed: dict[str, int]) -> list[str]:
    wrong = []
    for name, size in sorted(sizes.items()):
        most = allowed.get(name, limit)
        if size > most:
            wrong.append(f"{name}: {size} lines, more than {most}")
        elif name in allowed and size < most:
            wrong.append(f"{name}: {size} lines now: lower its entry to {max(size, limit)} "
                         f"(or drop it at {limit} or less)")
    wrong += [f"{name}: listed, but gone" for name in allowed if name not in sizes]
    return wrong


def test_no_module_grows_past_500_lines():
    modules, _ = _sizes()
    wrong = _check(modules, MODULE_LINES, MODULES_OVER)
    assert not wrong, "\n".join(wrong)


def test_no_function_grows_past_80_lines():
    _, functions = _sizes()
    wrong = _check(functions, FUNCTION_LINES, FUNCTIONS_OVER)
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_growth_and_stale_entries():
    assert _check({"a.py": 501}, 500, {}) == ["a.py: 501 lines, more than 500"]
    assert _check({"a.py": 600}, 500, {"a.py": 610})[0].startswith("a.py: 600 lines now")
    assert _check({}, 500, {"a.py": 610}) == ["a.py: listed, but gone"]
