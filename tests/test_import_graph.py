"""The house rules of the code: imports run one way (api -> service -> workers, and
bnrecal -> service -> workers: the ``bnrecal`` package is only a public face that
re-exports from ``service``), every layer may import the leaves beneath them all
(``bnrecal.errors``, the one error tree, which imports nothing of the project), and no module imports, directly or through others, a module
that imports it back. Inside ``workers`` and ``service`` the rooms have their own
directions (``ROOMS``), so the layout shows the architecture: the engine imports no Ray,
data and models know nothing of the ranks, the run pipeline nothing of the job server.

Every import statement counts, also one inside a function: a lazy import is still a
dependency. The graph is read from the source with ``ast``; nothing is imported. The
folders install as ``bnrecal.service``, ``bnrecal.workers`` and ``bnrecal.api`` (one
top-level name, docs/architecture.md), so the code imports them by those names only; the
graph names a module by its folder (``service.run.report.document``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "bnrecal", "service", "workers")
LAYER = {"api": 2, "bnrecal": 2, "service": 1, "workers": 0}
LEAVES = ("bnrecal.errors",)
"""Modules below every layer: any module may import them, and they import nothing of ours."""

# The rooms of a package and the other rooms of it each may import directly. Modules at a
# package's top (its shared helpers: errors, files, settings, the client, ...) are not
# rooms: any room may import them, and they import no room unless listed in TOP_MAY_IMPORT.
ROOMS = {
    "workers": {
        "data": set(),
        "engine": {"data"},
        "programs": {"engine"},
        "models": {"programs"},
        "ranks": {"data", "engine", "programs", "models"},
    },
    "service": {
        "export": set(),
        "run": {"export"},
        "sweep": {"run", "export"},
        "live": {"run", "export", "sweep", "jobserver"},  # jobserver: the job spec of recalibrate(server=...)
        "jobserver": {"run", "export", "sweep"},
        "cli": {"run", "export", "jobserver", "sweep"},
    },
}
TOP_MAY_IMPORT = {
    "service.settings": set(),
    "service.client": {"jobserver"},  # the blob store's file-name limit
    "service.demo": set(),
    "service.tracking": {"run", "sweep"},  # MLflow runs of a run's and a sweep's reports
}
NO_RAY_ROOMS = ("workers.engine",)
SUB_ROOMS = {
    "workers.data": {
        "storage": set(),  # where the bytes live: below every format
        "formats": {"storage"},
        "shards": {"storage", "formats"},  # shards above formats
        "reading": {"storage", "formats", "shards"},
    },
}
"""Inside a room, its own rooms and the ones each may import; a room above all these may also
import the room's top modules, the rest only its ``SUB_ROOM_LEAVES``."""
SUB_ROOM_LEAVES = {"workers.data": {"integrity", "opened", "order", "summary"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


INSTALLED = "bnrecal."


def folder_name(module: str) -> str:
    """``bnrecal.service.run`` -> ``service.run``: the graph's name of an installed module."""
    if module.startswith(INSTALLED) and module[len(INSTALLED):].split(".")[0] in ("api", "service", "workers"):
        return module[len(INSTALLED):]
    return module


def bare_imports(path: Path) -> list[str]:
    """Absolute imports of ``service``/``workers``/``api`` without the ``bnrecal.`` in front:
    they would import a user's own package of that name once installed."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append(node.module)
    return [name for name in found if name.split(".")[0] in ("api", "service", "workers")]


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (resolved to existing modules)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [folder_name(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = folder_name(node.module or "")
            candidates = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def room_of(module: str) -> tuple[str, str] | None:
    """``(package, room)`` of a module inside a package's room, else None."""
    parts = module.split(".")
    if parts[0] in ROOMS and len(parts) >= 2 and parts[1] in ROOMS[parts[0]]:
        return parts[0], parts[1]
    return None


def external_imports(path: Path) -> set[str]:
    """Top-level names of everything ``path`` imports (``ray``, ``torch``, ...)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_code_imports_only_the_installed_names():
    """``from bnrecal.service...``, never ``from service...``: a user's ``service`` package
    beside their script would be imported instead (tests/test_packaging.py shows it)."""
    root = Path(__file__).resolve().parents[1]
    bare = [
        f"{path.relative_to(root)}: {name}"
        for folder in (*PACKAGES, "tests", "bench")
        for path in (root / folder).rglob("*.py")
        for name in bare_imports(path)
    ]
    assert bare == [], "import the installed names (bnrecal.service, ...):\n" + "\n".join(sorted(bare))


def layer(module: str) -> int:
    """How high a module sits: a leaf below everything, else its package's layer."""
    return -1 if module in LEAVES else LAYER[module.split(".")[0]]


def test_imports_run_one_way():
    upward = [
        f"{source} imports {target}"
        for source, targets in graph().items()
        for target in targets
        if layer(target) > layer(source)
    ]
    assert upward == [], "imports must run api -> service -> workers:\n" + "\n".join(sorted(upward))


def test_rooms_import_only_their_allowed_rooms():
    wrong = []
    for source, targets in graph().items():
        here = room_of(source)
        for target in targets:
            there = room_of(target)
            if there is None or there == here or there[0] != source.split(".")[0]:
                continue
            if here is None:
                allowed = TOP_MAY_IMPORT.get(source, set()) if source.count(".") == 1 else set(ROOMS[there[0]])
            else:
                allowed = ROOMS[here[0]][here[1]]
            if there[1] not in allowed:
                wrong.append(f"{source} imports {target}")
    assert wrong == [], "rooms import only the rooms ROOMS allows them:\n" + "\n".join(sorted(wrong))


def test_sub_rooms_import_one_way():
    """``workers.data``'s rooms stack: storage, formats, shards, reading; each imports only
    the rooms below it and the room's leaves (a format never imports a shard dataset or the
    dataset description; storage knows no format), so a new format is one module above
    storage and a new place for bytes one module below every format."""
    wrong = []
    for source, targets in graph().items():
        for room, subs in SUB_ROOMS.items():
            if not source.startswith(room + "."):
                continue
            here = source[len(room) + 1:].split(".")[0]
            if here not in subs:
                continue
            for target in targets:
                if not target.startswith(room + "."):
                    continue
                there = target[len(room) + 1:].split(".")[0]
                top = target.count(".") == room.count(".") + 1
                allowed = there == here or there in subs[here] or (top and there in SUB_ROOM_LEAVES[room])
                if here == "reading" and top:
                    allowed = True
                if not allowed:
                    wrong.append(f"{source} imports {target}")
    assert wrong == [], "sub-rooms import only the rooms below them:\n" + "\n".join(sorted(wrong))
    for room, subs in SUB_ROOMS.items():
        on_disk = {p.parent.name for p in (ROOT / room.replace(".", "/")).glob("*/__init__.py")}
        assert on_disk == set(subs), f"{room}: rooms on disk {sorted(on_disk)} vs SUB_ROOMS {sorted(subs)}"


def test_every_room_says_what_it_owns():
    """Each room's ``__init__`` has a docstring, and every room on disk is in ROOMS."""
    for package, rooms in ROOMS.items():
        on_disk = {p.parent.name for p in (ROOT / package).glob("*/__init__.py")}
        assert on_disk == set(rooms), f"{package}: rooms on disk {sorted(on_disk)} vs ROOMS {sorted(rooms)}"
        for room in rooms:
            tree = ast.parse((ROOT / package / room / "__init__.py").read_text())
            doc = ast.get_docstring(tree) or ""
            assert len(doc.split()) >= 20, f"{package}/{room}/__init__.py needs a paragraph saying what it owns"


def test_engine_imports_no_ray():
    """The calibration math runs in any process: no Ray in the engine, not even lazily."""
    with_ray = [
        name for name, path in modules().items()
        if name.startswith(NO_RAY_ROOMS) and "ray" in external_imports(path)
    ]
    assert with_ray == [], f"these engine modules import Ray: {with_ray}"


def test_packages_keep_few_loose_modules():
    """A newcomer sees rooms, not a heap: at most 8 loose modules at the top of each."""
    for package in ROOMS:
        loose = sorted(p.name for p in (ROOT / package).glob("*.py") if p.name != "__init__.py")
        assert len(loose) <= 8, f"{package}/ has {len(loose)} loose modules: {loose}"


def test_leaves_import_nothing_of_ours():
    """``bnrecal.errors`` is imported by every layer, so it may import none of them (nor torch):
    anything it imported would sit beneath every module of the product."""
    edges = graph()
    for leaf in LEAVES:
        assert leaf in edges, f"{leaf} is not in the graph"
        assert edges[leaf] == set(), f"{leaf} imports {sorted(edges[leaf])}"
        path = ROOT / (leaf.replace(".", "/") + ".py")
        assert external_imports(path) <= {"__future__"}, f"{leaf} imports {sorted(external_imports(path))}"
    assert "bnrecal.errors" in edges["workers.engine.calibrator"] and "bnrecal.errors" in edges["api.problems"]


def test_bnrecal_only_reexports_from_service():
    """``bnrecal`` imports ``service`` (and the error tree) and nothing else of the project, and
    nothing imports it but for the error tree."""
    edges = graph()
    wrong = [
        f"{source} imports {target}"
        for source, targets in edges.items()
        for target in targets
        if target not in LEAVES and (
            (source.startswith("bnrecal") and not target.startswith(("service", "workers.lazy")))
            or (target.startswith("bnrecal") and not source.startswith("bnrecal"))
        )
    ]
    assert wrong == [], "bnrecal -> service -> workers:\n" + "\n".join(sorted(wrong))
    assert "service.live" in edges["bnrecal"]
    tree = ast.parse((ROOT / "bnrecal" / "__init__.py").read_text())
    logic = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    assert logic == [], "bnrecal holds no logic: define it in service"


def test_no_import_cycles():
    edges = graph()
    # A package's __init__ may re-export its own modules; a module importing its own
    # package's __init__ is the same room, not a cycle.
    for name in edges:
        edges[name] = {t for t in edges[name] if not (name.startswith(t + ".") and (ROOT / t.replace(".", "/") / "__init__.py").exists())}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_graph_sees_real_imports():
    """The test above would pass on an empty graph: make sure it reads what is there."""
    edges = graph()
    assert "service.jobserver.server" in edges["api.app"]
    assert "bnrecal.errors" in edges["service.cli.main"]
    assert "service.cli.local" in edges["service.cli.main"]
    assert "workers.engine.calibrator" in edges["workers.engine.statistics_pass"]
    assert "service.run.recalibrate" in edges["service.jobserver.cluster.hosted_work"]
    assert room_of("workers.ranks.process.actor") == ("workers", "ranks") and room_of("workers.files") is None
