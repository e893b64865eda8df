"""The package's layout shows the process boundary (issue 12): read from the imports themselves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "dist_kernel"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every dist_kernel module -> the dist_kernel modules it imports (at any depth of its code)."""
    graph: dict[str, set[str]] = {}
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_module_of_the_package_imports_itself_round_in_a_cycle():
    graph = _imports()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_parent_never_imports_what_runs_inside_the_ranks():
    graph = _imports()
    crossing = {(m, d) for m, deps in graph.items() if m.startswith("dist_kernel.parent")
                for d in deps if d.startswith("dist_kernel.rank")}
    assert crossing == set()


def test_the_ranks_never_import_the_parent():
    graph = _imports()
    crossing = {(m, d) for m, deps in graph.items() if m.startswith("dist_kernel.rank")
                for d in deps if d.startswith("dist_kernel.parent")}
    assert crossing == set()


def test_no_kernel_process_imports_the_jupyterlab_server_pieces():
    """``dist_kernel.lab`` runs in the Jupyter server (issue 35): the parent, the ranks and the node
    agent stay light and never import it; only the command line does, when asked to start JupyterLab."""
    graph = _imports()
    kernel_side = ("dist_kernel.parent", "dist_kernel.rank", "dist_kernel.node")
    crossing = {(m, d) for m, deps in graph.items() if m.startswith(kernel_side)
                for d in deps if d.startswith("dist_kernel.lab")}
    assert crossing == set()
    importers = {m for m, deps in graph.items() if any(d.startswith("dist_kernel.lab") for d in deps)}
    assert {m for m in importers if not m.startswith("dist_kernel.lab")} == {"dist_kernel.cli"}


def test_the_node_agent_never_imports_the_parent():
    """The node agent starts processes and moves bytes: the parent's kernel (and jupyter_client's
    manager with it) stays out of it; what both sides need is in dist_kernel.processes."""
    graph = _imports()
    crossing = {(m, d) for m, deps in graph.items() if m.startswith("dist_kernel.node")
                for d in deps if d.startswith("dist_kernel.parent")}
    assert crossing == set()


def test_every_launcher_kind_is_one_row_of_the_table_whose_node_starter_serves_it():
    """``--launcher`` picks from one table, never from an if/elif: options.py takes its values and
    help from it, and each remote kind's row names a node starter class of that kind."""
    from dist_kernel.launchers import KINDS
    from dist_kernel.options import LAUNCHERS, OPTION
    from dist_kernel.parent.launch import gang_launcher_class
    from dist_kernel.parent.launch.local import LocalLauncher
    from dist_kernel.parent.launch.node_starters import node_starter_class
    from dist_kernel.parent.launch.remote import RemoteLauncher

    assert LAUNCHERS == tuple(k.name for k in KINDS) and OPTION["launcher"].default == KINDS[0].name
    for kind in KINDS:
        assert f"{kind.name}: {kind.where}" in OPTION["launcher"].help
        if kind.remote:
            assert node_starter_class(kind.name).kind == kind.name
            assert gang_launcher_class(kind.name) is RemoteLauncher
        else:
            assert gang_launcher_class(kind.name) is LocalLauncher


#: the batch system's commands: only its node starter runs them, or names them
_SLURM_COMMANDS = re.compile(r"\b(scancel|squeue|srun|sbatch)\b")


def test_only_the_slurm_starter_names_slurms_commands():
    """A launcher owns its kind (issue 37): cleanup, the reaper, ``clean`` and the rest of the
    launch package end a start through its starter, by kind, and name no batch system."""
    own = PACKAGE / "parent" / "launch" / "node_starters" / "slurm.py"
    named = [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != own
             for n, line in enumerate(path.read_text().splitlines(), 1) if _SLURM_COMMANDS.search(line)]
    assert named == []


def test_no_module_is_over_600_lines_and_no_class_over_400():
    """Issue 27: a module or a class past these sizes is split where its parts meet (ruff's C901
    keeps each function under a complexity of 15 the same way). Issue 37: the tests and the
    benchmarks follow the same rule as the package."""
    root = PACKAGE.parent
    too_big = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        text = path.read_text()
        where = str(path.relative_to(root))
        if len(text.splitlines()) > 600:
            too_big.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None \
                    and node.end_lineno - node.lineno + 1 > 400:
                too_big.append(f"{where}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_big == []
