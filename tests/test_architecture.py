"""The house rules of docs/architecture.md, read from the source with ``ast``: no import circle between hpc_train
modules (imports inside functions and under ``if TYPE_CHECKING`` count), login-node rooms never reach torch,
deepspeed or numpy, and every file and function stays small enough to read."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "hpc_train"
HEAVY = ("torch", "deepspeed", "numpy", "mpi4py")
# The modules a login node loads, and the node agents (which must start in moments): none of them may import a heavy
# package at module level, directly or through any hpc_train module they import at module level. Work that needs
# torch imports it inside the function that runs on a rank (ckpt export, bench, the probe task).
LOGIN_ROOMS = ("hpc_train", "hpc_train.__main__", "hpc_train.submit", "hpc_train.launch", "hpc_train.agent",
               "hpc_train.errors", "hpc_train.resources", "hpc_train.common", "hpc_train.run", "hpc_train.control",
               "hpc_train.fabric", "hpc_train.backends", "hpc_train.config", "hpc_train.failures", "hpc_train.login",
               "hpc_train.checkpoint.names", "hpc_train.checkpoint.manifest", "hpc_train.checkpoint.manager",
               "hpc_train.checkpoint.writer", "hpc_train.bench.cli", "hpc_train.bench.report", "hpc_train.rank.entry",
               "hpc_train.rank.agent", "hpc_train.integrations")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


@dataclass
class Module:
    name: str
    path: Path
    top: set[str] = field(default_factory=set)  # hpc_train modules imported at module level
    anywhere: set[str] = field(default_factory=set)  # ... at module level or inside a function
    heavy_top: set[str] = field(default_factory=set)  # heavy packages imported at module level


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return True
    return False


def _targets(node: ast.Import | ast.ImportFrom, module: Module, known: set[str]) -> list[str]:
    """The dotted names an import statement loads: ``from a.b import c`` loads ``a.b.c`` when that is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.name.split(".")
        if module.path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def _owner(name: str, known: set[str]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, Module]:
    modules = {_module_name(p): Module(_module_name(p), p) for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(modules)
    for module in modules.values():
        tree = ast.parse(module.path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            typing_only = _type_checking_only(node, parents)  # never run, but a circle all the same
            local = _in_function(node, parents) or typing_only
            for target in _targets(node, module, known):
                if target.split(".")[0] in HEAVY and not local:
                    module.heavy_top.add(target.split(".")[0])
                owner = _owner(target, known) if target.startswith("hpc_train") else None
                if owner and owner != module.name:
                    module.anywhere.add(owner)
                    if not local:
                        module.top.add(owner)
    return modules


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(graph.get(name, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[name] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _loaded_at_import(name: str, modules: dict[str, Module]) -> set[str]:
    """Every hpc_train module that importing ``name`` runs: its module-level imports and their parent packages."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in modules:
            continue
        seen.add(current)
        parts = current.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(modules[current].top)
    return seen


def test_no_import_circle_counting_imports_inside_functions() -> None:
    cycle = find_cycle({m.name: m.anywhere for m in import_graph().values()})
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _is_login(name: str) -> bool:
    return any(name == room or (room != "hpc_train" and name.startswith(room + ".")) for room in LOGIN_ROOMS)


def test_login_node_modules_reach_no_heavy_package() -> None:
    modules = import_graph()
    login = [name for name in modules if _is_login(name)]
    assert "hpc_train.login.submit" in login and "hpc_train.config.plan" in login
    bad = {}
    for name in login:
        for loaded in sorted(_loaded_at_import(name, modules)):
            if modules[loaded].heavy_top:
                bad[name] = f"{loaded} imports {', '.join(sorted(modules[loaded].heavy_top))} at module level"
                break
    assert not bad, "login-node modules that reach a heavy package:\n" + "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_config_imports_nothing_above_it() -> None:
    allowed = ("hpc_train.config", "hpc_train.errors", "hpc_train.resources", "hpc_train.run", "hpc_train.backends",
               "hpc_train.common")
    offenders = {name: sorted(t for t in m.anywhere if not t.startswith(allowed) and t != "hpc_train")
                 for name, m in import_graph().items() if name.startswith("hpc_train.config")}
    assert not {k: v for k, v in offenders.items() if v}


# The rooms of docs/architecture.md and what each may import (its own modules always). Data flows one way: the
# run folder's protocol and the pure helpers at the bottom, the config above them, the login commands and the rank
# side above the config; nothing below imports anything above it.
ROOMS = {  # room: module prefixes, longest match wins
    "base": ("hpc_train", "hpc_train._moved", "hpc_train.errors", "hpc_train.resources"),
    "doors": ("hpc_train.__main__", "hpc_train.submit", "hpc_train.launch", "hpc_train.agent"),
    "pure": ("hpc_train.common",),
    "run": ("hpc_train.run",),
    "control": ("hpc_train.control",),
    "fabric": ("hpc_train.fabric",),
    "backends": ("hpc_train.backends",),
    "config": ("hpc_train.config",),
    "failures": ("hpc_train.failures",),
    "checkpoint": ("hpc_train.checkpoint",),
    "login": ("hpc_train.login",),
    "bench": ("hpc_train.bench",),
    "entry": ("hpc_train.rank", "hpc_train.rank.entry", "hpc_train.rank.agent"),
    "distributed": ("hpc_train.rank.distributed",),
    "runtime": ("hpc_train.rank.runtime",),
    "train": ("hpc_train.rank.train",),
    "program": ("hpc_train.rank.program",),
    "integrations": ("hpc_train.integrations",),
}
_LOW = {"base", "pure", "run", "control", "fabric", "backends"}
_SHARED = _LOW | {"config", "failures"}  # what both sides stand on
RANK = {"entry", "distributed", "runtime", "train", "program"}  # hpc_train/rank/
ALLOWED = {
    "base": {"program", "login"},  # hpc_train.context() and hpc_train.Executor, inside functions: import stays light
    # the names people and scripts type; launch and agent reach the rank side only inside their functions
    "doors": {"base", "run", "login", "entry"},
    "pure": {"base"}, "fabric": {"base"}, "control": set(), "run": {"base", "pure", "control"},
    "backends": {"base", "pure", "run"},
    "config": {"base", "pure", "run", "backends"},
    "failures": _LOW | {"config"},
    # the format (names, manifest, manager, writer) stands on the low rooms; the transaction and the engines'
    # adapters on the rank side's collectives and runtime, export on the model specs
    "checkpoint": _SHARED | {"distributed", "runtime"},
    "login": _SHARED | {"checkpoint", "bench", "doors"},  # doors: the callable submitit pickles (RankEntry)
    "bench": _LOW | {"config", "distributed"},  # config: what native bf16 is (precision_rule), for bench.machine
    "entry": _SHARED | {"checkpoint", "distributed", "runtime", "train", "program"},
    "distributed": _LOW | {"config"},
    "runtime": _SHARED | {"distributed"},
    "train": _SHARED | {"checkpoint", "distributed", "runtime"},
    # train only inside a function: the DeepSpeed file engine, for an engine a program hands to ctx.checkpoint
    "program": _SHARED | {"checkpoint", "distributed", "runtime", "train"},
    "integrations": {"base", "program"},  # program only inside functions: importable on a login node
}


def room_of(module: str) -> str:
    matches = [(len(prefix), room) for room, prefixes in ROOMS.items() for prefix in prefixes
               if module == prefix or (prefix != "hpc_train" and module.startswith(prefix + "."))]
    return max(matches)[1]


def test_each_room_imports_only_the_rooms_the_architecture_allows() -> None:
    wrong = sorted(f"{name} ({room_of(name)}) imports {target} ({room_of(target)})"
                   for name, module in import_graph().items() for target in module.anywhere
                   if room_of(target) != room_of(name) and room_of(target) not in ALLOWED[room_of(name)])
    assert not wrong, "imports that docs/architecture.md does not allow:\n" + "\n".join(wrong)


def test_files_and_functions_stay_small() -> None:
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_ruff_lints_every_python_file() -> None:
    """ruff's default excludes (``dist``, ``build``, ...) match at any depth: a folder with such a name would
    silently go unlinted, as hpc_train/dist once did."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (scripts/bootstrap.sh installs it)")
    listed = subprocess.run([ruff, "check", "--show-files", "."], cwd=REPO, capture_output=True, text=True,
                            check=True, timeout=60).stdout
    linted = {Path(line.strip()).resolve() for line in listed.splitlines() if line.strip().endswith(".py")}
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True,
                             timeout=60).stdout.split()
    missing = sorted(p for p in tracked if (REPO / p).resolve() not in linted)
    assert not missing, f"ruff check . does not lint: {missing[:10]}"


def test_programs_stand_on_the_runtime_not_on_the_trainer() -> None:
    """A rank program (your function or script) takes its preemption watch, watchdog, stops, attempts, checkpoint
    transaction, random state, monitor and entry-point loader from hpc_train.rank.runtime; the DeepSpeed trainer's room
    is imported only inside the function that installs DeepSpeed's file engine on an engine a program hands over.
    The runtime itself knows no engine."""
    graph = import_graph()
    at_top = sorted(f"{name} imports {target}" for name, module in graph.items() if room_of(name) == "program"
                    for target in module.top if room_of(target) == "train")
    assert not at_top, at_top
    engine_bound = sorted(f"{name} imports {target}" for name, module in graph.items() if room_of(name) == "runtime"
                          for target in module.anywhere if room_of(target) in ("train", "program"))
    assert not engine_bound, engine_bound
    deepspeed_at_top = sorted(name for name, module in graph.items() if room_of(name) == "runtime"
                              and "deepspeed" in module.heavy_top)
    assert not deepspeed_at_top, deepspeed_at_top


def _side(name: str) -> str | None:
    return next((side for side in ("login", "rank") if name.startswith(f"hpc_train.{side}")), None)


def test_the_login_side_and_the_rank_side_never_import_each_other() -> None:
    """hpc_train/login/ and hpc_train/rank/ are a folder boundary a newcomer sees: neither imports the other, not
    even inside a function. What both need lives below them (config, run, failures, checkpoint's format); the
    doors at the top (``python -m hpc_train.launch``, submitit's RankEntry) name the rank side for the login
    side."""
    crossing = sorted(f"{name} imports {target}" for name, module in import_graph().items()
                      for target in module.anywhere if _side(name) and _side(target) and _side(name) != _side(target))
    assert not crossing, "imports across the login/rank boundary:\n" + "\n".join(crossing)
