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


#: the modules above the trainer: the command line, the tools, and the agent rollouts the trainer runs as a stage
ABOVE_TRAIN = {"longstraw.__main__", "longstraw.cli", "longstraw.tools.compare", "longstraw.agent", "longstraw.agent.rollout",
               "longstraw.agent.environment"}


def test_nothing_below_the_trainer_imports_it():
    """The engine (capture, the prompt state, sampling, replay, layer kinds, the bridge to transformers, the
    distributed parts) never imports `longstraw.train`: the trainer is built on it, not the other way round."""
    upward = imports_of_the_trainer(import_graph()[0])
    assert not upward, f"(module, trainer module it imports): {upward}"


def imports_of_the_trainer(graph) -> list[tuple[str, str]]:
    """(module below the trainer, trainer module it imports)."""
    return sorted((m, d) for m, deps in graph.items() if not m.startswith("longstraw.train") and m not in ABOVE_TRAIN
                  for d in deps if d.startswith("longstraw.train"))


def imports_above_the_ops(graph) -> list[tuple[str, str]]:
    """(op module, module above the ops that it imports)."""
    return sorted((m, d) for m, deps in graph.items() if m.startswith("longstraw.ops")
                  for d in deps if not d.startswith("longstraw.ops") and d not in OPS_MAY_IMPORT)


def test_the_tier_checks_see_an_upward_import(tmp_path):
    """The two tier checks themselves, on a package with one upward import each (one of them function-local) and
    one allowed downward import (the trainer reading the state)."""
    pkg = tmp_path / "longstraw"
    (pkg / "train").mkdir(parents=True)
    for f in ("__init__.py", "state.py", "train/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "train" / "trainer.py").write_text("from ..state import x\n")
    (pkg / "sampler.py").write_text("def f():\n    from .train.trainer import Trainer\n")
    (pkg / "ops").mkdir()
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "attention.py").write_text("from ..sampler import f\n")
    graph, _ = import_graph(pkg)
    assert imports_of_the_trainer(graph) == [("longstraw.sampler", "longstraw.train.trainer")]
    assert imports_above_the_ops(graph) == [("longstraw.ops.attention", "longstraw.sampler")]


def test_moved_modules_keep_their_old_import_path():
    """`import longstraw.trainer` (moved to `longstraw.train.trainer`) gives the same module object, which keeps its
    own `__spec__`, and warns once with a DeprecationWarning naming the new path; importing the old path
    `longstraw.prepare` leaves the public function `longstraw.prepare` in place; in a fresh interpreter, so that
    nothing is imported yet."""
    import subprocess
    import sys

    from longstraw._moved import MOVED

    code = ("import importlib, warnings\n"
            "from longstraw._moved import MOVED\n"
            "for old, new in MOVED.items():\n"
            "    with warnings.catch_warnings(record=True) as w:\n"
            "        warnings.simplefilter('always')\n"
            "        a = importlib.import_module(old)\n"
            "    assert a is importlib.import_module(new), old\n"
            "    assert [str(x.message) for x in w if x.category is DeprecationWarning] == "
            "[f'{old} moved to {new}; the old name goes in the next release'], (old, [str(x.message) for x in w])\n"
            "    assert a.__spec__.name == new, (old, a.__spec__.name)\n"
            "import longstraw, types\n"
            "assert isinstance(longstraw.prepare, types.FunctionType), longstraw.prepare\n"
            "print(len(MOVED))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(len(MOVED))


#: what the pure tensor ops may import besides each other: the leaf modules (exceptions, where builds are kept)
OPS_MAY_IMPORT = {"longstraw.errors", "longstraw.paths"}


def test_the_ops_import_nothing_of_the_models():
    """`longstraw.ops` (split attention, latent and compressed attention, log-probs, 8-bit tokens, kernels) is the
    bottom tier: it imports only itself and the leaf modules, never a layer kind, the prompt state or the bridge to
    transformers."""
    upward = imports_above_the_ops(import_graph()[0])
    assert not upward, f"(op module, module above it that it imports): {upward}"
