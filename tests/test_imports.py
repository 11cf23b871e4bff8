"""The package's import graph, read from the source (nothing is imported): no circles but a registry importing
its members, no `_private` name imported across modules, and the rollout wing's rooms kept apart."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mgrpo")
# modules that import their members so the members can register themselves with them
REGISTRIES = {
    "mgrpo.rollout.engine",
    "mgrpo.models.registry",
    "mgrpo.rewards.registry",
    "mgrpo.rollout.multiturn.registry",
    "mgrpo.loss.registry",
}


def modules(root: str = ROOT) -> dict:
    """{dotted name: path} of every module under `root`."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _resolve(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(mods: dict) -> dict:
    """{module: {(imported module, imported name or None)}}, function-level imports included."""
    out = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    target = _resolve(a.name, mods)
                    if target and target != m:
                        out[m].add((target, None))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    target = sub if sub in mods else _resolve(base, mods)
                    if target and target != m:
                        out[m].add((target, None if target == sub else a.name))
    return out


def circles(graph: dict, registries=REGISTRIES) -> list:
    """Strongly connected components of more than one module, after dropping each registry -> member edge (a
    member is a module that imports the registry)."""
    edges = {m: {t for t, _ in deps} for m, deps in graph.items()}
    for reg in registries & set(edges):
        edges[reg] = {t for t in edges[reg] if reg not in edges.get(t, ())}
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return imports(modules())


def test_no_import_circles_but_registries_and_their_members(graph):
    assert circles(graph) == []


def test_the_circle_check_finds_a_circle():
    """Negative control: the server -> child -> worker -> server circle this layout removed is found."""
    g = {
        "a.server": {("a.child", "x")},
        "a.child": {("a.worker", None)},
        "a.worker": {("a.server", "y")},
        "a.registry": {("a.member", None)},
        "a.member": {("a.registry", "register")},
    }
    assert circles(g, registries={"a.registry"}) == [["a.child", "a.server", "a.worker"]]


def test_no_private_names_imported_across_modules(graph):
    private = sorted(
        f"{m} imports {name} from {target}"
        for m, deps in graph.items()
        for target, name in deps
        if name and name.startswith("_")
    )
    assert private == []


@pytest.mark.parametrize(
    "room, forbidden",
    [
        (
            "mgrpo.weights.transports",
            (
                "mgrpo.rollout.engines",
                "mgrpo.rollout.manager",
                "mgrpo.serving.server",
                "mgrpo.serving.vllm_child",
                "mgrpo.serving.vllm_worker",
            ),
        ),
        (
            "mgrpo.rollout.engines",
            (
                "mgrpo.serving.server",
                "mgrpo.serving.vllm_child",
                "mgrpo.serving.vllm_worker",
                "mgrpo.rollout.manager",
            ),
        ),
        ("mgrpo.serving", ("mgrpo.rollout.engines", "mgrpo.rollout.manager")),
        ("mgrpo.weights.bucket", ("mgrpo",)),
    ],
)
def test_rollout_rooms(graph, room, forbidden):
    """Transports, engines and what runs in an engine's process depend on each other only one way: an engine
    starts its serving process by name, never imports it; a transport knows no engine's internals."""
    bad = sorted(
        f"{m} -> {t}"
        for m, deps in graph.items()
        if m == room or m.startswith(room + ".")
        for t, _ in deps
        if any(t == f or t.startswith(f + ".") for f in forbidden)
    )
    assert bad == []


def test_every_module_imports_in_a_fresh_interpreter():
    """Each module of the package imports on its own (a process started as `python -m mgrpo.serving.vllm_child`
    meets a broken import only at run time otherwise)."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, warnings, mgrpo\n"
        "warnings.filterwarnings('ignore')\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(mgrpo.__path__, 'mgrpo.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{m.name}: {exc!r}')\n"
        "print('\\n'.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr[-2000:]
