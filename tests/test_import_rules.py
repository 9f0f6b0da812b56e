"""The layer rules, read from the source with ``ast`` (nothing is imported or run):

* outside ``dht/``, code imports from ``dht`` only the names ``dht.__all__`` exports, never a
  ``dht.<submodule>``; dht's own tests and benchmarks (``DHT_OWN``) test its internals and may;
* ``dht`` imports neither torch nor p2ptrain, anywhere (function-level imports included);
* no import cycle among the modules of ``dht/`` and ``p2ptrain/`` (module-level imports, those
  under ``if TYPE_CHECKING:`` excepted).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: dht's own tests and benchmarks: they test or measure its internals (wire, noise, mux, routing,
#: storage, relay, ...), so they may import its submodules
DHT_OWN = {
    "benchmarks/dht_bench.py", "benchmarks/dht_sim.py", "benchmarks/flood.py", "benchmarks/store_flood.py",
    *(f"tests/test_{name}.py" for name in (
        "bootstrap", "dht_sim", "flood", "frames", "fuzz_handlers", "holepunch", "hostile_records", "hostile_streams",
        "identity",
        "interfaces", "latency", "multiaddr", "mux", "node", "noise", "owned", "pool_decrypt", "private_swarm", "relay",
        "routing", "sealer", "storage", "swarm_processes", "transport", "watchers", "wire",
    )),
}
#: submodules anyone may import for now, and why
ALLOWED_SUBMODULES: dict[str, str] = {}
#: (file, submodule) pairs allowed, and why
ALLOWED_USES = {
    ("benchmarks/allreduce_bench.py", "dht.connection"):
        "the --frame experiment lowers connection.MAX_FRAME_BODY, which has no public setting",
}


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: not in functions, classes or TYPE_CHECKING."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def _all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _dht_all() -> set[str]:
    for node in _parse(ROOT / "dht/__init__.py").body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("dht/__init__.py defines no __all__ list")


def dht_api_violations(source: str, rel: str, exported: set[str]) -> list[str]:
    """How ``source`` (of the file ``rel``) reaches past ``dht``'s public API (``exported``), a line each."""
    out: list[str] = []
    tree = ast.parse(source, filename=rel)

    def submodule(name: str, line: int) -> None:
        if name not in ALLOWED_SUBMODULES and (rel, name) not in ALLOWED_USES:
            out.append(f"{rel}:{line}: imports {name} (use the names `dht` exports)")

    for node in _all_imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dht."):
                    submodule(alias.name, node.lineno)
        elif node.level == 0 and node.module is not None and node.module.startswith("dht."):
            submodule(node.module, node.lineno)
        elif node.level == 0 and node.module == "dht":
            out += [f"{rel}:{node.lineno}: imports dht.{a.name}, which dht.__all__ does not export"
                    for a in node.names if a.name not in exported]
    return out


def _module_names() -> dict[str, Path]:
    """Every module of dht and p2ptrain (compiled extensions included), by dotted name."""
    mods = {}
    for pkg in ("dht", "p2ptrain"):
        for path in (ROOT / pkg).rglob("*"):
            if path.suffix not in (".py", ".so") or "__pycache__" in path.parts:
                continue
            parts = [*path.relative_to(ROOT).parent.parts, path.name.split(".")[0]]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _extension_source(package: Path | None, name: str) -> bool:
    """Whether ``name`` is a compiled module of ``package`` whose source is there but whose build
    may not be (a clean clone): importing it does not import the package's ``__init__``."""
    return package is not None and package.name == "__init__.py" and any(package.parent.glob(f"{name}.c"))


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports at module level."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _module_level(_parse(path).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else
                           None if _extension_source(mods.get(base), a.name) else base for a in node.names]
            for target in filter(None, targets):
                while target and target not in mods:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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


def test_code_outside_dht_uses_only_its_public_api():
    exported = _dht_all()
    files = [p for p in _python_files("p2ptrain", "benchmarks", "examples", "tests") if _rel(p) not in DHT_OWN]
    problems = [line for p in files for line in dht_api_violations(p.read_text(), _rel(p), exported)]
    assert not problems, "\n".join(problems)


def test_dht_imports_neither_torch_nor_p2ptrain():
    problems = []
    for path in _python_files("dht"):
        for node in _all_imports(_parse(path)):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: within dht
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            problems += [f"{_rel(path)}:{node.lineno}: imports {n}" for n in names
                         if n.split(".")[0] in ("torch", "p2ptrain")]
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    found = cycles(import_graph(_module_names()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_rules_catch_what_they_forbid():
    """The checks themselves: each flags a violation planted in scratch source or a scratch graph."""
    bad = ("import dht\nfrom dht import DHTNode, Record\nfrom dht.storage import owned_name\n"
           "def f():\n    import dht.wire\n")
    found = dht_api_violations(bad, "p2ptrain/bad.py", {"DHTNode"})
    assert [line.split(":")[1] for line in found] == ["2", "3", "5"], found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
