"""The layering, checked on the real imports: what a process loads is what its modules import."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def loaded_by(module: str) -> set[str]:
    """Top-level names in sys.modules after a fresh interpreter imports `module` (and nothing else)."""
    code = f"import json, sys, {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize("module", ["scheduler.service", "scheduler.core", "core.protocol", "core.sampling",
                                    "kvstore.directory", "gateway.app"])
def test_process_modules_without_torch(module):
    """The scheduler and gateway processes never load torch: request-level types live in core/."""
    loaded = loaded_by(module)
    assert "core" in loaded or module.startswith("core")
    assert "torch" not in loaded
    assert "worker" not in loaded


@pytest.mark.parametrize("module", ["worker.loop", "worker.null", "family.manifest", "family.source",
                                    "family.tokenizer", "family.hfconfig"])
def test_worker_protocol_and_null_workers_without_torch(module):
    """The worker protocol is torch-free (32 null workers per process stay small), and so is the family
    as data (the gateway reads it)."""
    assert "torch" not in loaded_by(module)


# ---- the import rule (docs/ARCHITECTURE.md, "Layers") --------------------------------------------
PACKAGES = ["core", "family", "kernels", "kvstore", "scheduler", "worker", "gateway", "engine", "service", "training",
            "evaluation", "benches", "mfs"]
# Which project packages each package may import (besides itself). mfs/ is the top layer: anything.
ALLOWED = {
    "core": set(),
    "family": set(),
    "kernels": set(),
    "kvstore": {"core"},
    "scheduler": {"core", "kvstore"},
    "worker": {"core", "family", "kernels"},
    "gateway": {"core", "family"},
    # the in-process engine, the process launcher, then training < evaluation < benches; the CLI on top
    "engine": {"core", "family", "kernels", "kvstore", "scheduler", "worker"},
    "service": {"core", "family"},
    "training": {"core", "family", "kernels", "kvstore", "scheduler", "worker", "engine"},
    "evaluation": {"core", "family", "kernels", "kvstore", "scheduler", "worker", "engine", "service", "training"},
    "benches": set(PACKAGES) - {"benches", "mfs"},
    "mfs": set(PACKAGES) - {"mfs"},
}
# Upward imports that remain, each with why; the test fails when one disappears, so the list only shrinks.
EXCEPTIONS: set[tuple[str, str]] = set()
# Third-party packages a layer must never load.
FORBIDDEN_THIRD_PARTY = {
    "core": {"torch", "redis", "aiohttp", "transformers", "numpy", "xgrammar"},
    "family": {"torch", "redis", "aiohttp"},  # transformers only when a tokenizer or config is read
    "kvstore": {"torch", "aiohttp"},
    "scheduler": {"torch", "aiohttp", "transformers"},
    "gateway": {"torch"},
}
# Single modules allowed one of their layer's forbidden packages, each with why.
THIRD_PARTY_EXCEPTIONS = {
    # the one Redis connection factory every process uses (plain or Sentinel); nothing else in
    # core/ may load redis, and the processes that import core.protocol alone still do not
    ("core.redisconn", "redis"),
    # the one translation of a structured-output spec into a grammar, imported inside the
    # function that needs it: the gateway checks a request's spec with it, the worker compiles it
    ("core.grammar", "xgrammar"),
    # the family's base weights read as tensors: imported only by those who load weights (worker,
    # training, evaluation, benches), never by family/'s data modules, which the gateway reads (checked
    # on what they load, above)
    ("family.loader", "torch"),
}
# The gateway's HTTP side: only these modules may import aiohttp. Below the views (serving, the wire
# format, the OpenAPI document, the config) the gateway takes plain values, never a request object.
GATEWAY_HTTP = {"gateway.__main__", "gateway.app", "gateway.auth", "gateway.keys", "gateway.routes",
                "gateway.views"}
# Import cycles between modules that remain (all inside one package, both through a lazy import:
# kernels.ops picks the Triton table through kernels.triton_ops, which imports KernelOps from it).
def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def imported_names(path: Path) -> set[str]:
    """Every module name an import statement in the file names (function-level ones included, those
    under ``if TYPE_CHECKING:`` not: they never run)."""
    names: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit_else(child)
                continue
            if isinstance(child, ast.Import):
                names.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names.add(child.module)
                names.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    def visit_else(node):
        for child in node.orelse:
            visit(ast.Module(body=[child], type_ignores=[]))

    visit(ast.parse(path.read_text()))
    return names


def module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to its longest module prefix; a
    module's own enclosing packages do not count: Python initialises them first anyway)."""
    mods = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for name in imported_names(path):
            parts = name.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods),
                          None)
            if target is not None and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def test_lower_layers_never_import_higher_ones():
    upward, seen_exceptions = [], set()
    for m, targets in module_graph().items():
        pkg = m.split(".")[0]
        for t in targets:
            tpkg = t.split(".")[0]
            if tpkg == pkg or tpkg in ALLOWED[pkg]:
                continue
            if (m, tpkg) in EXCEPTIONS:
                seen_exceptions.add((m, tpkg))
                continue
            upward.append(f"{m} imports {t}")
    assert not upward, "imports against docs/ARCHITECTURE.md's layer map:\n" + "\n".join(sorted(upward))
    assert seen_exceptions == EXCEPTIONS, f"no longer needed in EXCEPTIONS: {EXCEPTIONS - seen_exceptions}"


def test_the_layer_map_has_no_cycle():
    order, left = [], {p: set(ALLOWED[p]) for p in PACKAGES}
    while left:
        ready = [p for p, deps in left.items() if deps <= set(order)]
        assert ready, f"the allowed imports form a cycle among {sorted(left)}"
        order += ready
        for p in ready:
            del left[p]


def test_no_import_cycles_between_modules():
    graph = module_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def strong(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(comp)

    for v in graph:
        if v not in index:
            strong(v)
    assert cycles == [], sorted(map(sorted, cycles))


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN_THIRD_PARTY))
def test_layers_never_import_heavy_dependencies(pkg):
    bad, excepted = [], set()
    for m, path in project_modules().items():
        if m.split(".")[0] != pkg:
            continue
        for n in imported_names(path):
            top = n.split(".")[0]
            if top in FORBIDDEN_THIRD_PARTY[pkg]:
                if (m, top) in THIRD_PARTY_EXCEPTIONS:
                    excepted.add((m, top))
                else:
                    bad.append(f"{m} imports {n}")
    assert not bad, bad
    mine = {e for e in THIRD_PARTY_EXCEPTIONS if e[0].split(".")[0] == pkg}
    assert excepted == mine, f"no longer needed in THIRD_PARTY_EXCEPTIONS: {mine - excepted}"


def test_gateway_http_stays_in_its_views():
    bad = [f"{m} imports {n}" for m, path in project_modules().items()
           if m.startswith("gateway.") and m not in GATEWAY_HTTP
           for n in imported_names(path) if n.split(".")[0] == "aiohttp"]
    assert not bad, bad


@pytest.mark.parametrize("module", ["gateway.serving", "gateway.config", "gateway.openapi"])
def test_gateway_below_its_views_never_loads_aiohttp(module):
    """What a process loads, not only what the files name: no dependency drags aiohttp in either."""
    assert "aiohttp" not in loaded_by(module)
