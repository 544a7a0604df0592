"""The package's import graph: no import circle, and no module importing another's private names.

Every import counts, function-local ones included (they are how circles hide); two kinds do not, because they never
run as an import of the module: imports under `if TYPE_CHECKING:` (annotations) and those inside a module's
`__getattr__` (the re-export of a moved name, kept for one release with a deprecation warning).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "longstraw"


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for f in sorted(package.rglob("*.py")):
        name = ".".join(f.relative_to(package.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _not_run_as_imports(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(module → the package modules it imports, [(module, imported module, private name)])."""
    mods = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        skip = _not_run_as_imports(tree)
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    target = base + (f".{node.module}" if node.module else "")
                else:
                    target = node.module or ""
                if target not in mods:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    graph[m].add(sub if sub in mods else target)
                    if sub not in mods and a.name.startswith("_") and not a.name.startswith("__"):
                        private.append((m, target, a.name))
        graph[m].discard(m)
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    graph, _ = import_graph()
    found = cycles(graph)
    detail = [" ↔ ".join(c) + ": " + "; ".join(f"{a} → {b}" for a in c for b in sorted(graph[a]) if b in c)
              for c in found]
    assert not found, "import circles:\n" + "\n".join(detail)


def test_no_module_imports_another_modules_private_names():
    _, private = import_graph()
    assert not private, f"(module, from, private name): {private}"


def test_the_check_sees_a_circle_and_a_private_import(tmp_path):
    """The checks themselves: a two-module circle held together by a function-local import is found, and so is an
    import of a private name; an annotation-only import is not an edge."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n"
                              "from .a import f\n")
    (pkg / "d.py").write_text("from .c import f\nfrom .a import _hidden\n")
    graph, private = import_graph(pkg)
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert private == [("pkg.d", "pkg.a", "_hidden")]
