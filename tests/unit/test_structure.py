"""The shape of the code (issues 31 and 46): no import cycles (imports by string counted), short functions and
classes, and a `mars migrate` (a Helm hook) that loads no model runtime. The layer contracts themselves are
`make lint`'s (lint-imports, .importlinter).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "mars",
    "mars_tools",
    "mars_stack",
    "mars_gateway",
    "mars_ingress",
    "mars_state",
    "mars_memory",
    "mars_router",
    "mars_dispatch",
    "mars_judge",
)
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _string_imports(source: str, modules: set[str]) -> set[str]:
    """The project's modules a module names in a string it may import at run time: a whole string constant
    that is a dotted module name, or "module:attribute" (importlib.import_module); mars.topology's own
    run-time imports are the entry points' (_entry_point_imports). A bare top-level name ("mars") is a word
    more often than an import: left out."""
    named = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name, colon, _ = node.value.partition(":")
            if name in modules and ("." in name or colon):
                named.add(name)
    return named


def _entry_point_imports() -> dict[str, set[str]]:
    """The modules mars.topology loads through the `mars.deployables` entry points (pyproject.toml): the
    deployables' specs, imported at run time by name."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    table = pyproject["project"]["entry-points"]["mars.deployables"]
    return {"mars.topology": {target.partition(":")[0] for target in table.values()}}


def _import_graph() -> dict[str, set[str]]:
    # grimp reads every import statement, the ones inside functions too; strings naming a module are added.
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    modules = {m for m in graph.modules if not m.startswith("mars.v1")}
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i in modules} - {m} for m in modules}
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            edges[module] |= _string_imports(Path(spec.origin).read_text(), modules) - {module}
    for module, targets in _entry_point_imports().items():
        edges[module] |= targets & modules
    return edges


def test_string_imports_are_found() -> None:
    source = 'import importlib\nimportlib.import_module("b.c")\nX = "a.b:Settings"\nY = "d"\nZ = "e:f"'
    assert _string_imports(source, {"a.b", "b.c", "d", "e"}) == {"a.b", "b.c", "e"}


def test_no_import_cycles_among_the_projects_modules_counting_imports_by_string() -> None:
    edges = _import_graph()
    assert len(edges) > 150, "the graph should hold the whole project"
    assert "mars_router.spec" in edges["mars.topology"], "topology's entry points should be edges"
    assert _cycles(edges) == []


def test_no_class_in_services_or_infra_is_over_300_lines() -> None:
    long = []
    for name in _source_files():
        for node in ast.walk(ast.parse((REPO / name).read_text())):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def _source_files() -> list[str]:
    files = subprocess.run(
        ["git", "ls-files", "services", "infra"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [name for name in files if name.endswith(".py") and "/v1/" not in name]


def test_no_function_in_services_or_infra_is_over_80_lines() -> None:
    long = []
    for name in _source_files():
        for node in ast.walk(ast.parse((REPO / name).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", "--config", str(REPO / ".importlinter")],
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_import_contract_refuses_a_service_importing_another(tmp_path: Path) -> None:
    """`make lint`'s contracts on a copy of the tree where the judge reads the router's settings: the
    deployables' independence breaks, and says which import broke it. The untouched tree keeps it."""
    for top in ("services", "infra"):
        for package in (REPO / top).iterdir():
            if package.name.startswith("mars") and (package / "__init__.py").exists():
                (tmp_path / package.name).symlink_to(package)
    assert _lint_imports(tmp_path).returncode == 0
    (tmp_path / "mars_judge").unlink()
    judge = tmp_path / "mars_judge"
    judge.mkdir()
    for module in (REPO / "services" / "mars_judge").glob("*.py"):
        (judge / module.name).write_text(module.read_text())
    (judge / "rubric").symlink_to(REPO / "services" / "mars_judge" / "rubric")
    (judge / "schema.py").write_text((judge / "schema.py").read_text() + "\nfrom mars_router import settings\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0
    report = " ".join(broken.stdout.split())
    assert "no deployable imports another's modules BROKEN" in report
    assert "mars_judge.schema -> mars_router.settings" in report


def test_mars_migrate_help_loads_no_model_runtime() -> None:
    # The Helm hook's command: its imports are its start-up time and its image's needs.
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from mars_tools.cli import main; main(['migrate', '--help'])"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage: mars migrate" in run.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines() if "|" in line}
    assert {"mars", "mars_tools", "pydantic"} <= imported  # the import log was read
    assert not imported & {"faiss", "torch", "onnxruntime", "sentence_transformers", "transformers"}


def _environment_reads(tree: ast.AST) -> list[str]:
    """MARS_* names a module reads straight from os.environ (os.environ.get / [...] / os.getenv)."""
    found = []
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("MARS_"):
            found.append(key.value)
    return found


def test_the_environment_reader_finds_direct_reads() -> None:
    tree = ast.parse('import os\na = os.environ.get("MARS_X", "")\nb = os.environ["MARS_Y"]\nc = os.getenv("HOME")')
    assert _environment_reads(tree) == ["MARS_X", "MARS_Y"]


def test_mars_settings_are_read_only_through_the_settings_classes() -> None:
    """No module reads a MARS_* variable itself: services, tools and launchers take them from their typed
    settings models (pydantic-settings). The one exception is the env-file switch of the models themselves."""
    allowed = {("services/mars/config.py", "MARS_ENV_FILE")}
    reads = []
    for folder in ("services", "infra"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if "/v1/" in rel:
                continue
            reads += [(rel, name) for name in _environment_reads(ast.parse(path.read_text()))]
    assert [r for r in reads if r not in allowed] == []
