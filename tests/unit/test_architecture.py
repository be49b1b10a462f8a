"""The code's shape, read from its source (no imports, no processes): every product module short enough to read
(no file over 500 lines, no class over 300; the package, the SDK, the benchmarks and the scripts alike), and the
services talking to the engine through its facade (`Engine`), never through the step loop behind it (`EngineCore`,
`engine.core`)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300


def product_files() -> list[Path]:
    """The Python files of the package, the SDK, the benchmarks (bench/) and the scripts (scripts/), generated gRPC
    stubs left out."""
    files = [p for top in ("deltamesh", "sdk") for p in (ROOT / top).rglob("*.py")]
    files += [p for top in ("bench", "scripts") for p in (ROOT / top).glob("*.py")]
    return sorted(p for p in files if "_pb2" not in p.name and "__pycache__" not in p.parts)


def classes_over(tree: ast.AST, limit: int) -> list[tuple[str, int]]:
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_walk_finds_the_product_files():
    names = {p.relative_to(ROOT).as_posix() for p in product_files()}
    expected = {
        "deltamesh/engine/core.py",
        "sdk/src/deltamesh/client/client.py",
        "bench/serve.py",
        "scripts/make_default_model.py",
    }
    assert expected <= names, sorted(names)[:10]
    assert not any("_pb2" in name for name in names)


def test_no_product_file_is_over_500_lines():
    long = {}
    for path in product_files():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            long[path.relative_to(ROOT).as_posix()] = lines
    assert not long, f"split these by responsibility (at most {MAX_FILE_LINES} lines): {long}"


def test_no_class_is_over_300_lines():
    long = {}
    for path in product_files():
        for name, lines in classes_over(ast.parse(path.read_text()), MAX_CLASS_LINES):
            long[f"{path.relative_to(ROOT).as_posix()}:{name}"] = lines
    assert not long, f"split these by responsibility (at most {MAX_CLASS_LINES} lines): {long}"


def test_a_long_class_is_seen():
    source = "class Long:\n" + "    x = 1\n" * MAX_CLASS_LINES + "\n\nclass Short:\n    pass\n"
    assert classes_over(ast.parse(source), MAX_CLASS_LINES) == [("Long", MAX_CLASS_LINES + 1)]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def reaches_into_the_core(source: str) -> list[str]:
    """Where a module imports the engine core, or reads an object's `core` (`self.engine.core.failure`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("deltamesh.engine.core")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("deltamesh.engine.core"):
                found.append(f"from {node.module} import ...")
            elif node.module == "deltamesh.engine":
                found += [
                    f"from deltamesh.engine import {a.name}" for a in node.names if a.name in ("core", "EngineCore")
                ]
        elif isinstance(node, ast.Attribute) and node.attr == "core":
            name = _dotted(node)
            if not name.startswith("prometheus_client."):
                found.append(f"line {node.lineno}: {name}")
    return found


def test_the_services_use_the_engine_facade_not_its_core():
    services = sorted((ROOT / "deltamesh" / "services").rglob("*.py"))
    assert len(services) > 10
    reached = {}
    for path in services:
        if found := reaches_into_the_core(path.read_text()):
            reached[path.relative_to(ROOT).as_posix()] = found
    assert not reached, f"use (or add) an accessor of deltamesh.engine.Engine instead: {reached}"


def test_reaching_into_the_core_is_seen():
    source = (
        "import deltamesh.engine.core\n"
        "from deltamesh.engine import EngineCore\n"
        "from prometheus_client.core import GaugeMetricFamily\n"
        "ok = self.engine.failure\n"
        "bad = self.engine.core.failure\n"
    )
    assert reaches_into_the_core(source) == [
        "import deltamesh.engine.core",
        "from deltamesh.engine import EngineCore",
        "line 5: self.engine.core",
    ]
