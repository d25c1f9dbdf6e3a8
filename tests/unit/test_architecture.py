"""The layers stay apart, read from the source with ``ast`` (nothing is imported).

The runtime (``choreo/``) serves any workflow, so it may not know this one: no import of
the services, ingestion, the tools above the app, the domain's contracts or the benchmarks,
whether at module level or inside a function. The services reach Kafka, Redis and Avro only
through the runtime, which is where exactly-once, dedupe and fencing live. And the
project's top-level packages import each other without cycles, so each layer can be loaded
(and reasoned about) without the ones above it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from choreo.ops.topocheck import strongly_connected

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("choreo", "consumers", "producers", "infra", "registry", "schemas", "bench")
ABOVE_THE_RUNTIME = ("consumers", "producers", "infra", "registry", "schemas", "bench")
CLIENT_LIBRARIES = ("confluent_kafka", "redis", "fastavro")


@dataclass(frozen=True)
class Import:
    path: str  # of the importing file, relative to the repository
    module: str  # the imported module, absolute
    line: int
    runs_at_import: bool  # module level (not in a function, not under TYPE_CHECKING)

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    if not node.level:
        return node.module or ""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _dynamic(node: ast.Call) -> str | None:
    """``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in ("import_module", "__import__") and node.args:
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in the file, however deeply nested."""
    rel = path.relative_to(root).as_posix()
    found: list[Import] = []

    def visit(node: ast.AST, at_import: bool) -> None:
        for child in ast.iter_child_nodes(node):
            runs = at_import and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if _type_checking(node) and child in getattr(node, "body", ()):
                runs = False
            if isinstance(child, ast.Import):
                found.extend(Import(rel, alias.name, child.lineno, runs) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append(Import(rel, _absolute(child, path, root), child.lineno, runs))
            elif isinstance(child, ast.Call) and (name := _dynamic(child)):
                found.append(Import(rel, name, child.lineno, runs))
            visit(child, runs)

    visit(ast.parse(path.read_text(), filename=rel), True)
    return found


def sources(package: str) -> Iterator[Path]:
    yield from sorted((ROOT / package).rglob("*.py"))


def test_the_runtime_imports_nothing_above_it() -> None:
    wrong = [str(i) for path in sources("choreo") for i in imports_of(path)
             if i.package in ABOVE_THE_RUNTIME]
    assert not wrong, "the runtime must not depend on what runs on it:\n" + "\n".join(wrong)


def test_the_registry_is_a_product_of_its_own() -> None:
    """It serves any client: it knows no service, door, stack or contract of the app."""
    wrong = [str(i) for path in sources("registry") for i in imports_of(path)
             if i.package in ("consumers", "producers", "infra", "schemas", "bench")]
    assert not wrong, "the registry must not depend on the pipeline's app or tools:\n" + "\n".join(wrong)


def test_services_use_kafka_redis_and_avro_only_through_the_runtime() -> None:
    wrong = [str(i) for path in sources("consumers") for i in imports_of(path)
             if i.package in CLIENT_LIBRARIES]
    assert not wrong, "a service talks to the broker and Redis through choreo:\n" + "\n".join(wrong)


def test_services_import_only_the_runtimes_public_api() -> None:
    wrong = [str(i) for path in sources("consumers") for i in imports_of(path)
             if i.package == "choreo" and i.module != "choreo"]
    assert not wrong, "a service imports what choreo/__init__.py offers, nothing deeper:\n" + "\n".join(wrong)


def package_graph() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package → the files making that edge, module-level imports only
    (those are what a cycle breaks at load time)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for package in PACKAGES:
        for path in sources(package):
            for i in imports_of(path):
                if i.runs_at_import and i.package in PACKAGES and i.package != package:
                    files = edges.setdefault((package, i.package), [])
                    if i.path not in files:
                        files.append(i.path)
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[frozenset[str]]:
    """The groups of packages that import each other (``strongly_connected``)."""
    graph: dict[str, list[str]] = {p: [] for p in PACKAGES}
    for a, b in edges:
        graph[a].append(b)
    return [frozenset(group) for group in strongly_connected(graph)]


def test_top_level_packages_import_each_other_without_cycles() -> None:
    edges = package_graph()
    new = cycles(edges)
    report = [f"{a} -> {b}: {', '.join(files)}" for c in new for (a, b), files in sorted(edges.items())
              if a in c and b in c]
    assert not new, "import cycles between packages:\n" + "\n".join(report)


@pytest.mark.parametrize("source, expected", [
    ("import redis\n", [("redis", True)]),
    ("def f():\n    from consumers import fleet\n", [("consumers", False)]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import redis\n",
     [("typing", True), ("redis", False)]),
    ("import importlib\nX = importlib.import_module('schemas.models')\n",
     [("importlib", True), ("schemas.models", True)]),
    ("class A:\n    import fastavro\n", [("fastavro", True)]),
])
def test_imports_are_found_wherever_they_are(source: str, expected: list[tuple[str, bool]],
                                             tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(source)
    assert [(i.module, i.runs_at_import) for i in imports_of(tmp_path / "m.py", tmp_path)] == expected


def test_a_relative_import_is_resolved_in_its_package(tmp_path: Path) -> None:
    module = tmp_path / "choreo" / "ops" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("from .. import runner\nfrom ..state import T\nfrom . import records\n")
    assert [i.module for i in imports_of(module, tmp_path)] == ["choreo", "choreo.state", "choreo.ops"]


def test_a_cycle_is_found_and_a_chain_is_not() -> None:
    assert cycles({("choreo", "infra"): ["x"], ("infra", "choreo"): ["y"]}) == [frozenset({"choreo", "infra"})]
    assert cycles({("infra", "choreo"): ["y"], ("bench", "infra"): ["z"]}) == []


def test_the_supervisor_finds_its_workflow_without_being_told() -> None:
    """A tool that loads the workflow (the demo, topics, the ops commands, a user's script)
    needs no SUPERVISOR_WORKFLOW: the supervisor watches the workflow that lists it."""
    code = ("import infra.demo\n"
            "from consumers.workflow import WORKFLOW\n"
            "from choreo import topology\n"
            "from choreo.supervisor import service\n"
            "topology.derive(WORKFLOW)\n"
            "print(sorted(service.topics))\n")
    env = {k: v for k, v in os.environ.items() if k != "SUPERVISOR_WORKFLOW"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'delivery.failed'" in done.stdout and "'package.cancelled'" in done.stdout, done.stdout
