"""The layout is the architecture: every import points down the layers below, no
two files import each other in a circle, no module is started by a string naming a
room above it, and no module reaches for another's private names. Read from the
source with `ast`, so a lazy or TYPE_CHECKING import counts like any other."""
from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("schedules", "bamboo", "agents", "commands", "cloud", "sim")

# Lowest first. A module may import its own room and any room on an earlier line;
# rooms on one line are siblings and may not import each other.
LAYERS = (
    ("schedules",),
    ("bamboo.control",),
    ("bamboo.data",),
    ("bamboo.model",),
    ("bamboo.transport",),
    ("bamboo.state",),
    ("bamboo.runtime",),
    ("agents",),
    ("commands.train", "commands.data"),
    ("commands.status", "commands.chaos", "commands.scale"),
    ("sim",),
    ("cloud",),
)
BOTTOM = ("bamboo", "commands")  # package faces that import nothing of ours


def module_files() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def room_of(module: str) -> str:
    rooms = [r for line in LAYERS for r in line] + list(BOTTOM)
    return max((r for r in rooms if module == r or module.startswith(r + ".")), key=len)


def rank_of(room: str) -> int:
    return -1 if room in BOTTOM else next(i for i, line in enumerate(LAYERS) if room in line)


def imports_of(module: str, source: str, known: set[str]) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """(modules imported, (module, private name) pairs imported, module names in strings)."""
    tree = ast.parse(source)
    is_package = module in PACKAGES or any(k.startswith(module + ".") for k in known)
    package = module if is_package else module.rpartition(".")[0]
    modules, private, strings = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                modules.add(full if full in known else base)
                if full not in known and alias.name.startswith("_"):
                    private.add((base, alias.name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            strings.add(node.value)
    return modules - {module}, private, strings - {module}


@functools.lru_cache(maxsize=1)
def graph() -> tuple[dict[str, set[str]], dict[str, set], dict[str, set[str]]]:
    files = module_files()
    known = set(files)
    edges, private, strings = {}, {}, {}
    for module, path in files.items():
        edges[module], private[module], strings[module] = imports_of(module, path.read_text(), known)
    return edges, private, strings


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a room above the importer's, or of a sibling room."""
    bad = []
    for module, targets in edges.items():
        here = room_of(module)
        for target in targets:
            there = room_of(target)
            if there != here and rank_of(there) >= rank_of(here):
                bad.append(f"{module} -> {target} ({here} may not import {there})")
    return sorted(bad)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_room_and_every_room_a_module():
    files = module_files()
    rooms = {room_of(m) for m in files}
    assert rooms == {r for line in LAYERS for r in line} | set(BOTTOM)
    for room in rooms - {"sim", "schedules", "bamboo"}:
        assert ast.get_docstring(ast.parse(files[room].read_text())), f"{room} has no package docstring"


def test_imports_only_point_down():
    edges, _, _ = graph()
    assert upward(edges) == []


def test_no_file_level_import_circle():
    edges, _, _ = graph()
    assert circles(edges) == []


def test_no_module_is_started_by_a_string_naming_a_room_above_it():
    _, _, strings = graph()
    assert upward(strings) == []


def test_no_module_imports_another_modules_private_names():
    _, private, _ = graph()
    assert {m: p for m, p in private.items() if p} == {}


def test_the_schedule_compiler_never_imports_torch():
    for module, path in module_files().items():
        if room_of(module) == "schedules":
            assert "torch" not in {n.split(".")[0] for n in _imported_names(path.read_text())}, module


def _imported_names(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return names


def test_the_checks_catch_an_upward_import_a_sibling_a_circle_and_a_string():
    """The checkers themselves, on a made-up graph that breaks each rule once."""
    edges = {
        "bamboo.control.cluster": {"bamboo.runtime.worker"},        # up
        "sim.command": {"cloud.launch"},                            # up, too
        "bamboo.transport.comm": {"bamboo.transport.channels"},     # a circle ...
        "bamboo.transport.channels": {"bamboo.transport.comm"},     # ... of two
        "bamboo.runtime.failover": {"bamboo.control.cluster"},      # down: fine
    }
    assert upward(edges) == [
        "bamboo.control.cluster -> bamboo.runtime.worker (bamboo.control may not import bamboo.runtime)",
        "sim.command -> cloud.launch (sim may not import cloud)",
    ]
    assert circles(edges) == [["bamboo.transport.channels", "bamboo.transport.comm"]]
    source = 'import subprocess\nfrom .ir import _hidden\nsubprocess.run(["python", "-m", "agents.agent"])\n'
    modules, private, strings = imports_of("schedules.order", source, {"schedules.ir", "agents.agent"})
    assert modules == {"schedules.ir"} and private == {("schedules.ir", "_hidden")}
    assert upward({"schedules.order": strings}) == ["schedules.order -> agents.agent (schedules may not import agents)"]


def test_no_function_is_over_sixty_lines():
    """One screen per function: a longer one hides more than one step."""
    long = []
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []


def test_no_function_takes_more_than_eight_parameters():
    """A longer list is a value waiting to be named (ScheduleOptions, Stages, Watches)."""
    wide = []
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p]
                count = len([n for n in names if n not in ("self", "cls")])
                if count > 8:
                    wide.append(f"{module}.{node.name}: {count} parameters")
    assert wide == []


CHOICES = {"eager", "lazy", "off", "auto", "bubbles", "all", "end", "next", "none", "last", "1f1b", "gpipe",
           "fp32", "bf16", "fp16", "constant", "linear", "cosine", "gloo", "nccl"}
CHOICE_NAMES = {"redundancy", "mode", "sync", "replica_sync", "compiled_sync", "frc", "split", "backward_split",
                "order", "precision", "lr_schedule", "transport", "requested"}


def _choice_name(node) -> str | None:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name if name in CHOICE_NAMES else None


def bare_choices(source: str) -> list[int]:
    """Lines where a choice (a mode, a sync, ...) is compared with a string literal."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literals = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            literals += [e.value for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                         for e in s.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if any(_choice_name(s) for s in sides) and CHOICES & set(literals):
                lines.append(node.lineno)
    return lines


def test_no_choice_is_compared_as_a_bare_string():
    """Modes, syncs and the like are compared with their enum's members
    (schedules/options.py), so a misspelt value cannot pass silently."""
    found = {m: lines for m, path in module_files().items() if m not in ("schedules.options", "bamboo.control.config")
             if (lines := bare_choices(path.read_text()))}
    assert found == {}
    assert bare_choices('if cfg.redundancy == "off":\n    pass\n') == [1]  # the check sees one
    assert bare_choices('if sync in ("end", "next"):\n    pass\n') == [1]
    assert bare_choices('if cfg.redundancy == Redundancy.OFF:\n    pass\n') == []
