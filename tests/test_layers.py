"""The import layers of DESIGN.md §3, checked on the source: every module of ``ringcomm`` is
parsed with :mod:`ast` (nothing is imported, so cupy and torch need not be installed).

Checked: no module imports a higher layer; zmq, cupy and torch are imported only by the
modules that own them; the engine never reaches the transport; no private name crosses a
module boundary. Imports count wherever they are written: at module level, inside a function
(lazy), under ``if TYPE_CHECKING:`` (typing), or as a dotted ``"ringcomm.x"`` string handed to
``importlib.import_module`` (dynamic, e.g. a registry). A failure lists each offending edge
as ``importer -> imported (file:line, kind)``.

Known violations sit in the commented allow-lists below, so this test passes today and fails
on any new one; an allow-list entry that no longer occurs fails too, so the lists only shrink.

``python tests/test_layers.py`` prints the real import graph, grouped by layer.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ringcomm"

# --- the layer map (DESIGN.md §3) --------------------------------------------------------
# A module's layer is that of the longest key equal to its name or a dotted prefix of it
# ("ringcomm" itself matches only the package's own __init__). A module may import its own
# layer or any lower one, never a higher one.
LAYER_NAMES = {
    0: "base: errors, config, ops, schedule, xp and its stand-in, tuning.costmodel, "
    "core.lifecycle, core.flight, the wire format",
    1: "transport",
    2: "rendezvous",
    3: "the progress engine: core.progress and its parts (matching, dispatch, health, ...)",
    4: "core: group_core, forming, work, buffers, regroup, summary; device staging",
    5: "collectives + core.p2p",
    6: "group facade (group.py), collectives.hierarchy over its sub-groups",
    7: "ps, engine",
    8: "top: cli, bench, launch, torch_backend, tuning.hosts, the package's re-exports",
}
LAYERS: dict[str, int] = {
    "ringcomm._version": 0,
    "ringcomm.errors": 0,
    "ringcomm.config": 0,
    "ringcomm._conventions": 0,  # the launchers' variables, Slurm host lists, derived ports (pure)
    "ringcomm.ops": 0,  # reducers
    "ringcomm.schedule": 0,  # pure schedules
    "ringcomm.device.xp": 0,  # the only module that imports cupy
    "ringcomm.device.standin": 0,  # the host stand-in for cupy.ndarray; xp imports it, it imports nothing
    "ringcomm.device.standin_math": 0,  # the stand-in's arithmetic (imports nothing of ours)
    "ringcomm.tuning": 0,  # the package's own __init__ (imports nothing)
    "ringcomm.tuning.costmodel": 0,  # the alpha-beta-gamma cost model (pure): its public names
    "ringcomm.tuning.parameters": 0,  # the model's parameters and their JSON
    "ringcomm.tuning.plans": 0,  # algorithms as data (pure)
    "ringcomm.tuning.pricing": 0,  # predictions from plans
    "ringcomm.tuning.fitting": 0,  # fits to measured times
    "ringcomm.tuning.hosts": 8,  # ringcomm tune --hostfile: its probe job and fit
    "ringcomm.core.lifecycle": 0,  # the one exit hook
    "ringcomm.core.flight": 0,  # the flight recorder and its report (pure but for its file)
    "ringcomm.core.deadline": 0,  # a call's deadline, made once where it enters (pure)
    "ringcomm.transport.wire": 0,  # pure pack/unpack (in transport/, but below any socket)
    "ringcomm.transport.base": 0,  # the transport interface and path thresholds (pure)
    "ringcomm.transport": 1,  # the transport interface and its lanes; zmq lives here only
    "ringcomm.rendezvous": 2,
    "ringcomm.rendezvous.store_server": 2,  # the store's server (store.py: its client)
    "ringcomm.core.progress": 3,  # the engine: who drives, the ops; composes the parts below
    "ringcomm.core.op": 3,  # operations, and what they may use of the engine
    "ringcomm.core.control": 3,  # control messages: tags, sending, checking
    "ringcomm.core.health": 3,  # peers' liveness: goodbyes, departures, failure
    "ringcomm.core.aborts": 3,  # one outcome per collective: the aborts peers sent
    "ringcomm.core.matching": 3,  # posted receivers and unexpected messages
    "ringcomm.core.dispatch": 3,  # reading the transport, control messages, the query
    "ringcomm.core.fastlane": 3,  # the small blocking exchange without bookkeeping
    "ringcomm.core": 4,  # the group core and what it is made of (the __init__ imports nothing)
    "ringcomm.device": 4,  # the device side (the package's own __init__ imports nothing)
    "ringcomm.device.staging": 4,  # device staging, beside the group core
    "ringcomm.core.forming": 4,  # forming a world group: store, transport, progress -> core
    "ringcomm.collectives": 5,
    "ringcomm.collectives.registry": 5,  # every collective's algorithms by name
    "ringcomm.collectives.chooser": 5,  # a call's plan: algorithm, piece size, hier segments
    "ringcomm.collectives.checks": 5,  # the calls' argument checks
    "ringcomm.collectives.stepped": 5,  # bases of the stepped algorithms (ring, spans, peer rows)
    "ringcomm.collectives.shm_fingerprint": 5,  # a call's fingerprint in a workspace control line
    "ringcomm.collectives.shm_base": 5,  # the shm job, the engine's interface, the rounds
    "ringcomm.collectives.shm_reduce": 5,  # shm all_reduce, reduce_scatter, reduce
    "ringcomm.collectives.shm_gather": 5,  # shm all_gather, gather, broadcast
    "ringcomm.collectives.shm_alltoall": 5,  # shm scatter, all_to_all
    "ringcomm.core.p2p": 5,
    "ringcomm.device.p2p": 5,  # device p2p: builds on p2p and staging
    "ringcomm.group": 6,  # ProcessGroup, the facade: nothing below imports it
    "ringcomm.collectives.hierarchy": 6,  # hierarchical collectives over a ProcessGroup's sub-groups
    # The naive reference collectives (test oracles) are written with ProcessGroup's p2p.
    "ringcomm.collectives.reference": 7,
    "ringcomm.ps": 7,
    "ringcomm.engine": 7,
    "ringcomm.bench": 8,
    "ringcomm.launch": 8,
    "ringcomm.torch_backend": 8,  # the torch backend and its device tensors and streams
    "ringcomm.torch_backend.tensors": 8,  # torch tensors as ringcomm arrays: checks, views, reduce ops
    "ringcomm.torch_backend.work": 8,  # the backend's Work and the threads that complete its futures
    "ringcomm.torch_backend.core": 8,  # what every call of one torch group needs: its ringcomm group, issue/call steps
    "ringcomm.torch_backend.reductions": 8,  # all-reduce, reduce, reduce-scatter over a BackendCore
    "ringcomm.torch_backend.movement": 8,  # broadcast, gathers, scatter, all-to-all, barrier over a BackendCore
    "ringcomm.torch_backend.p2p": 8,  # send, recv, the monitored barrier over a BackendCore
    "ringcomm.torch_backend.store": 8,  # forming the ringcomm group from torch's store; check-out at shutdown
    "ringcomm.torch_backend.process_group": 8,  # torch's ProcessGroup and creator
    "ringcomm.cli": 8,  # every subcommand's parser and driver
    "ringcomm.__main__": 8,
    "ringcomm": 8,  # ringcomm/__init__.py re-exports the public API (group, launch, ...)
}

# Third-party packages only their owning modules may import (a name or a dotted prefix).
CONFINED = {
    "zmq": ("ringcomm.transport",),  # today: transport.zmq_transport and transport.rpc
    "cupy": ("ringcomm.device.xp",),
    "cupyx": ("ringcomm.device.xp",),
    "torch": ("ringcomm.torch_backend", "ringcomm.bench.gloo"),
}

# "engine never touches the transport, only a ProcessGroup" (DESIGN §3).
FORBIDDEN = {
    "ringcomm.engine": ("ringcomm.transport", "ringcomm.rendezvous", "ringcomm.core.progress"),
}

# --- allow-lists: known violations, each to be fixed, none to be added ---------------------
# (importer, imported) -> why it is there today.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# (importer, "module._name") -> why. The importer uses another module's private helper.
KNOWN_PRIVATE: dict[tuple[str, str], str] = {}


# --- reading the source ------------------------------------------------------------------
@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str  # a ringcomm module, or a top-level third-party name
    path: str  # relative to the repository root
    line: int
    kind: str  # "import" | "lazy" | "typing" | "dynamic"

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.path}:{self.line}, {self.kind})"


@dataclass(frozen=True)
class PrivateUse:
    importer: str
    name: str  # "module._name"
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} uses {self.name} ({self.path}:{self.line})"


@cache
def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key == PACKAGE and module != PACKAGE:
            return None
        if key in LAYERS:
            return LAYERS[key]
    return None


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute module named by ``from <...> import``."""
    if not node.level:
        return node.module or ""
    is_package = module_files()[module].name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _kinds(tree: ast.Module) -> dict[int, str]:
    """id(node) -> "lazy" or "typing" for nodes inside a function or a TYPE_CHECKING block."""
    kinds: dict[int, str] = {}

    def mark(node: ast.AST, kind: str) -> None:
        for sub in ast.walk(node):
            kinds.setdefault(id(sub), kind)

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                mark(stmt, "typing")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            mark(node, "lazy")
    return kinds


DOTTED = re.compile(r"ringcomm(\.\w+)+(:\w+)?")  # "ringcomm.engine.dp:DataParallel"


def _calls_import_module(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, (ast.Attribute, ast.Name))
        and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) == "import_module"
        for n in ast.walk(tree)
    )


@cache
def parsed(module: str) -> ast.Module:
    return ast.parse(module_files()[module].read_text(), filename=str(module_files()[module]))


@cache
def edges_of(module: str) -> tuple[Edge, ...]:
    modules = module_files()
    path = str(modules[module].relative_to(ROOT))
    tree = parsed(module)
    kinds = _kinds(tree)
    found: list[Edge] = []

    def add(target: str, node: ast.stmt | ast.expr, kind: str | None = None) -> None:
        top = target.split(".")[0]
        imported = target if top == PACKAGE else top
        kind = kind or kinds.get(id(node), "import")
        found.append(Edge(module, imported, path, node.lineno, kind))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else source, node)
    if _calls_import_module(tree):
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            if DOTTED.fullmatch(node.value):
                add(node.value.partition(":")[0], node, "dynamic")
    return tuple(sorted(found, key=lambda e: e.line))


def all_edges() -> Iterator[Edge]:
    for module in module_files():
        yield from edges_of(module)


def internal_edges() -> Iterator[Edge]:
    return (e for e in all_edges() if e.imported.split(".")[0] == PACKAGE)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(module: str) -> list[PrivateUse]:
    """``from X import _name`` and ``X._name`` on a ringcomm module X bound by an import."""
    modules = module_files()
    path = str(modules[module].relative_to(ROOT))
    tree = parsed(module)
    uses: list[PrivateUse] = []
    bound: dict[str, str] = {}  # local name -> the ringcomm module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != PACKAGE:
                    continue
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[PACKAGE] = PACKAGE
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:  # a submodule (a private module is the package's own)
                    bound[alias.asname or alias.name] = sub
                elif _is_private(alias.name):
                    uses.append(PrivateUse(module, sub, path, node.lineno))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        chain: list[str] = []
        base: ast.expr = node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not (isinstance(base, ast.Name) and base.id in bound):
            continue
        target = ".".join([bound[base.id], *reversed(chain)])
        if target in modules:
            uses.append(PrivateUse(module, f"{target}.{node.attr}", path, node.lineno))
    return sorted(uses, key=lambda u: u.line)


def all_private_uses() -> list[PrivateUse]:
    return [use for module in module_files() for use in private_uses(module)]


def _report(title: str, items: Sequence[object]) -> str:
    return f"{title} ({len(items)}):\n" + "\n".join(f"  {item}" for item in items)


# --- the checks ----------------------------------------------------------------------------
def test_every_module_has_a_layer() -> None:
    missing = [m for m in module_files() if layer_of(m) is None]
    assert not missing, "modules with no layer in LAYERS (tests/test_layers.py): " + ", ".join(
        missing
    )


def test_layer_map_names_real_modules() -> None:
    modules = module_files()
    stale = [k for k in LAYERS if not any(m == k or m.startswith(k + ".") for m in modules)]
    assert not stale, "LAYERS keys that match no module: " + ", ".join(stale)


def test_no_upward_import() -> None:
    upward = []
    for edge in internal_edges():
        low, high = layer_of(edge.importer), layer_of(edge.imported)
        if low is None or high is None or high <= low:
            continue
        if (edge.importer, edge.imported) not in KNOWN_UPWARD:
            upward.append(f"{edge}: layer {low} imports layer {high} ({LAYER_NAMES[high]})")
    assert not upward, _report("imports of a higher layer (DESIGN.md §3)", upward)


def test_third_party_stays_in_its_module() -> None:
    bad = [
        edge
        for edge in all_edges()
        if edge.imported in CONFINED
        and not any(
            edge.importer == home or edge.importer.startswith(home + ".")
            for home in CONFINED[edge.imported]
        )
    ]
    assert not bad, _report("zmq/cupy/torch imported outside their home modules (CONFINED)", bad)


def test_engine_never_touches_the_transport() -> None:
    bad = [
        edge
        for edge in internal_edges()
        for importer, banned in FORBIDDEN.items()
        if edge.importer.startswith(importer)
        and any(edge.imported == b or edge.imported.startswith(b + ".") for b in banned)
    ]
    assert not bad, _report("engine modules reaching the transport (FORBIDDEN)", bad)


def test_no_private_name_crosses_a_module() -> None:
    bad = [u for u in all_private_uses() if (u.importer, u.name) not in KNOWN_PRIVATE]
    assert not bad, _report(
        "private names used across a module boundary (make them public, or keep them home)", bad
    )


def test_allow_lists_are_current() -> None:
    edges = {(e.importer, e.imported) for e in internal_edges()}
    uses = {(u.importer, u.name) for u in all_private_uses()}
    gone = [k for k in KNOWN_UPWARD if k not in edges] + [k for k in KNOWN_PRIVATE if k not in uses]
    assert not gone, "allow-list entries that no longer occur (delete them): " + repr(gone)


def test_the_checks_see_known_shapes() -> None:
    """The walker resolves relative, submodule, lazy, typing and dynamic imports."""
    by_pair = {(e.importer, e.imported): e.kind for e in internal_edges()}
    assert ("ringcomm.group", "ringcomm.core.lifecycle") in by_pair  # from . import lifecycle
    assert ("ringcomm.group", "ringcomm.collectives.api") in by_pair  # from .collectives import
    assert by_pair[("ringcomm.collectives.reference", "ringcomm.group")] == "typing"
    assert by_pair[("ringcomm.launch.spawn", "ringcomm.group")] == "lazy"
    assert by_pair[("ringcomm.cli", "ringcomm.cli.train")] == "dynamic"
    assert any(e.imported == "cupy" for e in edges_of("ringcomm.device.xp"))


# --- the graph, for people ------------------------------------------------------------------
def print_graph() -> None:
    modules = module_files()
    for layer, name in LAYER_NAMES.items():
        print(f"== layer {layer}: {name}")
        for module in (m for m in modules if layer_of(m) == layer):
            targets: dict[str, set[str]] = {}
            for edge in edges_of(module):
                if edge.imported.split(".")[0] == PACKAGE and edge.imported != module:
                    targets.setdefault(edge.imported, set()).add(edge.kind)
            names = [
                t.removeprefix("ringcomm.")
                + ("" if "import" in k else "[" + ",".join(sorted(k)) + "]")
                for t, k in sorted(targets.items())
            ]
            third = sorted(
                {e.imported for e in edges_of(module) if e.imported in CONFINED}
                | {e.imported for e in edges_of(module) if e.imported in ("msgpack", "mpi4py")}
            )
            extra = f"   (third-party: {', '.join(third)})" if third else ""
            print(f"  {module.removeprefix('ringcomm.')} -> {' '.join(names) or '-'}{extra}")
    for use in all_private_uses():
        print(f"private: {use}")


if __name__ == "__main__":
    print_graph()
    sys.exit(0)
