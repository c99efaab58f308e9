"""The layering contract of docs/layers.md: kvmesh's modules import one another without
circles, each part imports only the parts below it, and the router's HTTP path keeps its floors.

Imports are read from the source with `ast`, so every import counts: at module level, inside
functions, and under `if TYPE_CHECKING:`. A module imported for its types is still one its
reader must understand first, so a circle through a type-only import is still a circle.

The allow-lists below record what breaks a rule today, each with its reason. They only shrink:
an entry that no longer applies fails the test until it is deleted.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "kvmesh"

# The parts, and those each may import besides itself. cli is the `kvmesh` command (cli.py and
# commands/) on top of everything; flags are the config-to-flag modules that cli builds its
# parsers from and the simulator reads `kvmesh serve`'s flags with.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "protocol": frozenset(),
    "engine": frozenset({"protocol"}),
    "router": frozenset({"protocol"}),
    "flags": frozenset({"protocol", "engine"}),
    "sim": frozenset({"protocol", "engine", "router", "flags"}),
    "plan": frozenset({"protocol", "engine", "router", "flags", "sim"}),
    "bench": frozenset({"protocol"}),
    "cli": frozenset({"protocol", "engine", "router", "flags", "sim", "plan", "bench"}),
}
# modules whose part is not their package's
PART_OF_MODULE = {
    "kvmesh.cli": "cli",
    "kvmesh.commands.flags": "flags",
    "kvmesh.commands.serve_flags": "flags",
}

# Floors of the router's HTTP path, bottom to top (router.state draws them): a module imports
# only modules on its own floor or below.
ROUTER_FLOORS: tuple[tuple[str, ...], ...] = (
    ("chunked", "proxy", "request_reader"),  # the HTTP/1.1 wire: knows nothing of the router
    ("upstream_pool", "request_parser"),  # how endpoints are reached, how bodies are read
    ("state",),  # the typed interfaces: RouterState, Door, Serving
    ("forward",),  # one request to one endpoint
    ("handlers",),  # the routes: parse, pick, forward, retry
    ("frontdoor", "listener"),  # the HTTP server: a Handler per request
    ("app",),  # the Router: its state and lifecycle, wiring the above together
)

# Circles that remain today, by their members, each with the change that breaks it (see
# docs/layers.md, "What is left").
KNOWN_CYCLES: dict[frozenset[str], str] = {}

# Imports across parts that the table above forbids, by reason.
_IN_PROCESS_ENGINE = "runs engine cores in process in virtual time: a simulation, not HTTP"
_COST_MODEL = "the cost model lives in engine/emulation until it has a part of its own"
_MICRO = "a micro-benchmark of internals: its home is beside the tests, not `kvmesh bench`"
_TOKENIZER = "loads the tokenizer through the engine (protocol.prompt could serve it)"
_WORKLOADS = "the agentic and trace workloads are shared with bench's load client"
_AS_SCRIPT = "`python -m` of a bench module runs it through the `kvmesh` parser"
ALLOWED: dict[tuple[str, str], str] = {
    ("bench.engine_bench", "cli"): _AS_SCRIPT,
    ("bench.spec_bench", "cli"): _AS_SCRIPT,
    ("bench.ep_bench", "engine.config"): _IN_PROCESS_ENGINE,
    ("bench.ep_bench", "engine.emulation.dp_group"): _IN_PROCESS_ENGINE,
    ("bench.ep_bench", "engine.emulation.expert_load"): _COST_MODEL,
    ("bench.ep_bench", "engine.emulation.instance_roofline"): _COST_MODEL,
    ("bench.ep_bench", "engine.emulation.latency"): _COST_MODEL,
    ("bench.ep_bench", "engine.emulation.layouts"): _COST_MODEL,
    ("bench.ep_bench", "engine.emulation.wide_ep"): _COST_MODEL,
    ("bench.ep_bench", "engine.tokenizer"): _TOKENIZER,
    ("bench.ep_load", "engine.emulation.dp_group"): _IN_PROCESS_ENGINE,
    ("bench.ep_load", "engine.sequence"): _IN_PROCESS_ENGINE,
    ("bench.spec_emulated", "engine.config"): _IN_PROCESS_ENGINE,
    ("bench.spec_emulated", "engine.emulation.dp_group"): _IN_PROCESS_ENGINE,
    ("bench.spec_emulated", "engine.emulation.latency"): _COST_MODEL,
    ("bench.spec_emulated", "engine.emulation.spec"): _COST_MODEL,
    ("bench.spec_emulated", "engine.emulation.wide_ep"): _COST_MODEL,
    ("bench.spec_emulated", "engine.emulation.work"): _IN_PROCESS_ENGINE,
    ("bench.spec_emulated", "engine.sequence"): _IN_PROCESS_ENGINE,
    ("bench.spec_emulated", "engine.tokenizer"): _TOKENIZER,
    ("bench.tier_stall_bench", "engine.builder"): _MICRO,
    ("bench.tier_stall_bench", "engine.config"): _MICRO,
    ("bench.tier_stall_bench", "engine.sequence"): _MICRO,
    ("sim.agents", "bench.workloads"): _WORKLOADS,
    ("sim.requests", "bench.workloads"): _WORKLOADS,
    ("sim.agents_cli", "bench.cli_args"): _WORKLOADS,
    ("sim.replay", "bench.cli_args"): _WORKLOADS,
    ("plan.targets", "bench.workloads"): _WORKLOADS,
}


def short(module: str) -> str:
    return module.removeprefix(f"{ROOT}.")


def part_of(module: str) -> str:
    """A module's part: PART_OF_MODULE's, else its first package under kvmesh."""
    if module in PART_OF_MODULE:
        return PART_OF_MODULE[module]
    head = module.split(".")[1]
    return "cli" if head == "commands" else head


def module_files() -> dict[str, Path]:
    """Every kvmesh module by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        names = list(path.relative_to(SRC).with_suffix("").parts)
        if names[-1] == "__init__":
            names.pop()
        found[".".join(names)] = path
    return found


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The kvmesh modules that ``module`` imports, anywhere in its source."""
    names = set(known)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path.name == "__init__.py", node)
            # `from pkg import sub` imports the module pkg.sub when there is one
            wanted = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names
            ]
        else:
            continue
        for name in wanted:
            while name and name not in names:  # a namespace package's name: its nearest module
                name = name.rpartition(".")[0]
            if name and name != module and name != ROOT:
                out.add(name)
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: _targets(name, path, files) for name, path in files.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The groups of two or more modules that reach each other (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(frozenset(group))
    return groups


def shortest_cycle(graph: dict[str, set[str]], group: frozenset[str]) -> list[str]:
    """A shortest circle through the group's modules, first module repeated at the end."""
    best: list[str] = []
    for start in sorted(group):
        came_from = {start: start}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if start in graph[node]:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                cycle = [*reversed(path), start]
                if not best or len(cycle) < len(best):
                    best = cycle
                break
            for nxt in sorted(graph[node] & group):
                if nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
    return best


def layer_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs, short names, that cross the parts against MAY_IMPORT."""
    bad: set[tuple[str, str]] = set()
    for module, targets in graph.items():
        if module == ROOT:
            continue
        src = part_of(module)
        for target in targets:
            dst = part_of(target)
            if dst != src and dst not in MAY_IMPORT[src]:
                bad.add((short(module), short(target)))
    return bad


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    floor = {f"{ROOT}.router.{m}": i for i, names in enumerate(ROUTER_FLOORS) for m in names}
    return sorted(
        f"{short(module)} (floor {floor[module]}) -> {short(target)} (floor {floor[target]})"
        for module, targets in graph.items()
        if module in floor
        for target in targets
        if target in floor and floor[target] > floor[module]
    )


def test_every_module_belongs_to_a_part() -> None:
    modules = set(import_graph())
    unknown = sorted({part_of(m) for m in modules if m != ROOT} - set(MAY_IMPORT))
    assert not unknown, f"parts missing from MAY_IMPORT in tests/test_layers.py: {unknown}"
    floors = {f"{ROOT}.router.{m}" for names in ROUTER_FLOORS for m in names}
    assert floors <= modules, sorted(floors - modules)


def test_no_import_cycles() -> None:
    known = {frozenset(f"{ROOT}.{m}" for m in group) for group in KNOWN_CYCLES}
    graph = import_graph()
    found = [g for g in strongly_connected(graph) if g not in known]
    shown = "\n".join(
        f"  {' -> '.join(map(short, shortest_cycle(graph, g)))}"
        f"  (in a circle of {len(g)}: {', '.join(sorted(map(short, g)))})"
        for g in found
    )
    assert not found, f"{len(found)} import circle(s) among kvmesh modules:\n{shown}"


def test_known_cycles_only_shrink() -> None:
    groups = {frozenset(map(short, g)) for g in strongly_connected(import_graph())}
    gone = [sorted(g) for g in KNOWN_CYCLES if g not in groups]
    assert not gone, f"broken: delete these from KNOWN_CYCLES in tests/test_layers.py: {gone}"


def test_parts_import_only_the_parts_below() -> None:
    new = sorted(layer_violations(import_graph()) - set(ALLOWED))
    shown = "\n".join(f"  {a} ({part_of(f'{ROOT}.{a}')}) -> {b}" for a, b in new)
    assert not new, f"imports across the layers of docs/layers.md:\n{shown}"


def test_allowed_imports_only_shrink() -> None:
    gone = sorted(set(ALLOWED) - layer_violations(import_graph()))
    shown = "\n".join(f"  {a} -> {b}" for a, b in gone)
    assert not gone, f"fixed: delete these from ALLOWED in tests/test_layers.py:\n{shown}"


def test_router_http_path_keeps_its_floors() -> None:
    up = floor_violations(import_graph())
    assert not up, "router modules importing a floor above their own:\n  " + "\n  ".join(up)


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Type-only, function-local and relative imports all count."""
    pkg = tmp_path / ROOT / "a"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvmesh.a.y import Y\n"
    )
    (pkg / "y.py").write_text("def f():\n    from . import z\n")
    (pkg / "z.py").write_text("from .x import X\n")
    known = ["kvmesh", "kvmesh.a", "kvmesh.a.x", "kvmesh.a.y", "kvmesh.a.z"]
    graph = {m: _targets(m, pkg / f"{m.rpartition('.')[2]}.py", known) for m in known[2:]}
    assert graph == {
        "kvmesh.a.x": {"kvmesh.a.y"},
        "kvmesh.a.y": {"kvmesh.a.z"},
        "kvmesh.a.z": {"kvmesh.a.x"},
    }
    (group,) = strongly_connected(graph)
    assert shortest_cycle(graph, group) == ["kvmesh.a.x", "kvmesh.a.y", "kvmesh.a.z", "kvmesh.a.x"]
