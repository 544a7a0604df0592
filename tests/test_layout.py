"""The package's import graph: no import circle, no import of a higher tier, and no module reading another's private
names or members.

Every import counts, of every kind: function-local ones (they are how circles hide), those under `if
TYPE_CHECKING:` (annotations: a type named across tiers ties them as much as a call does) and those inside a
module's `__getattr__` (a lazy re-export). What importing a package runs (its `__init__`, before any submodule) counts
only its imports that run then: not its annotation-only or lazy ones.
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


def import_graph(package: Path = PACKAGE, every: bool = True) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(module → the package modules it imports, [(module, imported module, private name)]). `every` False: only the
    imports that run when the module is imported (not those under `if TYPE_CHECKING:` or in `__getattr__`)."""
    mods = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        skip = set() if every else _not_run_as_imports(tree)
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
    detail = [
        " ↔ ".join(c) + ": " + "; ".join(f"{a} → {b}" for a in c for b in sorted(graph[a]) if b in c) for c in found
    ]
    assert not found, "import circles:\n" + "\n".join(detail)


def test_no_module_imports_another_modules_private_names():
    _, private = import_graph()
    assert not private, f"(module, from, private name): {private}"


def private_reads(package: Path = PACKAGE) -> list[tuple[str, str]]:
    """(module, private attribute) for every `x._name` a module reads where `_name` is a private attribute, method or
    function of another module of the package and of none of its own (`self._name` / `cls._name` and `super()._name`
    are the class's own business). Private names of other libraries are not counted."""
    mods = _modules(package)
    trees = {m: ast.parse(f.read_text()) for m, f in mods.items()}
    own: dict[str, set[str]] = {m: set() for m in mods}
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own[m].add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own[m].add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own[m].add(node.id)
    defined = set().union(*own.values())
    found = []
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if node.attr in defined and node.attr not in own[m]:
                found.append((m, node.attr))
    return sorted(set(found))


def test_no_module_reads_another_modules_private_members():
    """What modules share of each other is public (`PromptState.parts`, `branch_cache`, `replay_cache`,
    `checked_response`, `Group.fail`, ...): no module reads a private member another module defines."""
    found = private_reads()
    assert not found, f"(module, private member of another module): {found}"


#: what a function may import where it runs: optional dependencies (the `datasets`, `gguf` and `tensorboard`
#: extras), a Unix-only module (`resource`); a package's `__getattr__` (a lazy re-export) may import its own modules
LOCAL_IMPORTS_ALLOWED = {"datasets", "gguf", "torch.utils.tensorboard", "wandb", "resource"}


def local_imports(package: Path = PACKAGE) -> list[str]:
    """`module:line name` of every import inside a function, but those `LOCAL_IMPORTS_ALLOWED`."""
    found = []
    for name, path in _modules(package).items():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = ["." * node.level + (node.module or "")]
                else:
                    continue
                lazy = fn.name == "__getattr__" and path.name == "__init__.py" and targets[0].startswith(".")
                if not lazy and not all(t in LOCAL_IMPORTS_ALLOWED for t in targets):
                    found.append(f"{name}:{node.lineno} {', '.join(targets)}")
    return sorted(set(found))


def test_functions_import_only_optional_dependencies():
    """Imports sit at the top of their module (what a module needs shows there, and the tier check reads it), but
    for optional dependencies and a package's lazy re-export."""
    found = local_imports()
    assert not found, f"function-local imports: {found}"


def test_the_check_sees_a_function_local_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def __getattr__(name):\n    from . import a\n    return a\n")
    (pkg / "a.py").write_text(
        "def f():\n    import json\n    import gguf\n    return json\n\n"
        "def __getattr__(name):\n    from .b import g\n    return g\n"
    )
    assert local_imports(pkg) == ["pkg.a:2 json", "pkg.a:7 .b"]


def test_the_check_sees_a_circle_and_a_private_import(tmp_path):
    """The checks themselves: a two-module circle held together by a function-local import is found, one held
    together by an annotation-only import too, and so is an import of a private name."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\nfrom .a import f\n"
    )
    (pkg / "d.py").write_text("from .c import f\nfrom .a import _hidden\n")
    graph, private = import_graph(pkg)
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert cycles(import_graph(pkg, every=False)[0]) == [["pkg.a", "pkg.b"]]
    assert private == [("pkg.d", "pkg.a", "_hidden")]


def test_the_check_sees_a_private_member_read_from_another_module(tmp_path):
    """A module reading another module's private attribute or method is found; its own, `self._x`, `super()._x` and
    other libraries' private names are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "state.py").write_text(
        "class State:\n    def __init__(self):\n        self._parts = 1\n\n"
        "    def _cache(self):\n        return self._parts\n"
    )
    (pkg / "user.py").write_text(
        "import torch\n\ndef f(s, other):\n    torch._C\n    other._mine = 2\n"
        "    return s._cache(), s._parts, other._mine\n"
    )
    assert private_reads(pkg) == [("pkg.user", "_cache"), ("pkg.user", "_parts")]


#: The package's tiers, top to bottom (docs/design.md, "The tiers"): a module imports modules of its own tier or of a
#: lower one, never of a higher one. A module's tier is that of the entry naming it or its nearest enclosing package;
#: `longstraw` itself (the package's `__init__`: the public surface) is named on its own. A new module must be placed.
TIERS: list[tuple[str, ...]] = [
    ("longstraw.__main__", "longstraw.cli", "longstraw.commands"),  # the command line and its commands
    ("longstraw.tools",),  # the planner, one step three ways, the real models: each behind a command
    # the trainer and its stages (agent rollouts are one); the package's own surface (`longstraw`), which re-exports
    # `capture` and the state from below and, lazily, the TRL-shaped trainer from here
    ("longstraw.train", "longstraw.agent", "longstraw"),
    # apart: what the trainer, the tools and the command line are given (losses, tasks and the environment
    # convention their tools follow, the tiny and benchmark models); the engine below imports none of them
    ("longstraw.losses", "longstraw.tasks", "longstraw.agent.environment", "longstraw.testing"),
    ("longstraw.api",),  # `capture`, the one dispatcher
    ("longstraw.self_check",),
    ("longstraw.distributed",),  # context parallelism, FSDP2, collectives, ranks
    ("longstraw.replay",),  # every replay order (batched, segmented, layer-major) and what pieces carry between them
    ("longstraw.prompt_state",),  # PromptState, capture_local
    ("longstraw.branch",),  # one trajectory's own state on top of a prompt
    ("longstraw.ragged",),  # branches of one prompt decoded in one batch
    ("longstraw.sampler",),  # G responses from one state (reads the decoder, not the state)
    ("longstraw.model",),  # capability, preparation, observation, chunking, positions, oracles
    ("longstraw.archs",),  # family specs (one names a kind's stand-in: Jamba's mixer)
    ("longstraw.kinds",),  # one module per layer kind
    ("longstraw.hf",),  # the bridge to transformers' internals
    ("longstraw.ops",),  # pure tensor math and kernels
    ("longstraw.errors", "longstraw.paths"),  # leaves
]
ROOT_PACKAGE = "longstraw"


def tier_of(module: str, tiers=TIERS) -> int | None:
    """The index in `tiers` (0: the top) of the entry naming `module` or its nearest enclosing package; None: unplaced."""
    entry = tier_entry(module, tiers)
    return None if entry is None else entry[0]


def tier_entry(module: str, tiers=TIERS) -> tuple[int, str] | None:
    """(tier index, the entry of `tiers` that places `module`)."""
    best: tuple[int, str] | None = None
    for i, names in enumerate(tiers):
        for name in names:
            inside = name != ROOT_PACKAGE and module.startswith(name + ".")
            if (module == name or inside) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    return best


def runtime_imports(graph: dict[str, set[str]], run: dict[str, set[str]] | None = None) -> list[tuple[str, str, str]]:
    """(module, module that importing it runs, the package whose `__init__` runs it or ""): each module it imports,
    and what the `__init__` of each package enclosing one of those imports runs (`run`: the imports that run on
    import; default `graph`) (Python runs a package's `__init__` before its submodule: `from ..agent.environment
    import ToolCall` runs `longstraw/agent/__init__.py` too), except the packages that enclose the importer as well
    (already run) and the root package."""
    run = graph if run is None else run
    out = []
    for m, deps in graph.items():
        for d in sorted(deps):
            out.append((m, d, ""))
            parts = d.split(".")
            for k in range(2, len(parts)):
                package = ".".join(parts[:k])
                if package in graph and not (m == package or m.startswith(package + ".")):
                    out += [(m, x, package) for x in sorted(run[package]) if x != m]
    return out


def upward_imports(graph: dict[str, set[str]], tiers=TIERS, run: dict[str, set[str]] | None = None) -> list[str]:
    """Every import of a module of a higher tier than the importer's, as "importer (tier) → imported (tier)"."""
    found = []
    for m, d, via in runtime_imports(graph, run):
        em, ed = tier_entry(m, tiers), tier_entry(d, tiers)
        if em is not None and ed is not None and ed[0] < em[0]:
            how = f" (run by {via}/__init__.py)" if via else ""
            found.append(f"{m} (tier {em[0]}: {em[1]}) → {d} (tier {ed[0]}: {ed[1]}){how}")
    return sorted(set(found))


def unplaced(graph: dict[str, set[str]], tiers=TIERS) -> list[str]:
    return sorted(m for m in graph if tier_of(m, tiers) is None)


def test_every_import_goes_down_the_tiers():
    """No module imports one of a higher tier (function-local imports count): nothing below the trainer imports it,
    the engine imports neither the tools nor `longstraw.testing`, the losses nor the tasks, the ops import only
    themselves and the leaves, and so on down `TIERS`."""
    upward = upward_imports(import_graph()[0], run=import_graph(every=False)[0])
    assert not upward, "imports of a higher tier:\n" + "\n".join(upward)


def test_every_module_has_a_tier():
    missing = unplaced(import_graph()[0])
    assert not missing, f"modules that no entry of TIERS (tests/test_layout.py) places: {missing}"


def test_the_tier_check_sees_an_upward_import(tmp_path):
    """The check itself, on a small package named like the real one: one upward import (function-local), one run by
    a package's `__init__`, one module no tier places; allowed: the trainer reading the state, a module importing
    another of its tier, the ops importing a leaf."""
    pkg = tmp_path / "longstraw"
    for d in ("train", "ops", "agent", "tasks"):
        (pkg / d).mkdir(parents=True)
    files = {
        "__init__.py": "",
        "errors.py": "",
        "prompt_state.py": "from .branch import Branch\n",
        "branch.py": "Branch = object\n",
        "sampler.py": "def f():\n    from .train.trainer import Trainer\n",
        "train/__init__.py": "",
        "train/trainer.py": "from ..prompt_state import Branch\nTrainer = object\n",
        "ops/__init__.py": "",
        "ops/attention.py": "from ..errors import *\n",
        "agent/__init__.py": "from .rollout import run\n",
        "agent/rollout.py": "from ..train.trainer import Trainer\nrun = Trainer\n",
        "agent/environment.py": "",
        "tasks/__init__.py": "",
        "tasks/tools.py": "from ..agent.environment import *\n",
        # an annotation-only import of a higher tier counts; a package's lazy re-export counts for the package, not
        # for what importing one of its submodules runs
        "ops/kernel.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sampler import f\n",
        "losses/__init__.py": "def __getattr__(name):\n    from ..train.trainer import Trainer\n    return Trainer\n",
        "losses/grpo.py": "",
        "tasks/reward.py": "from ..losses.grpo import *\n",
        "stray.py": "",
    }
    (pkg / "losses").mkdir()
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph, _ = import_graph(pkg)
    run, _ = import_graph(pkg, every=False)
    sampler, train, tasks, ops = (tier_of(f"longstraw.{m}") for m in ("sampler", "train", "tasks", "ops"))
    assert upward_imports(graph, run=run) == [
        f"longstraw.losses (tier {tasks}: longstraw.losses) → longstraw.train.trainer (tier {train}: longstraw.train)",
        f"longstraw.ops.kernel (tier {ops}: longstraw.ops) → longstraw.sampler (tier {sampler}: longstraw.sampler)",
        f"longstraw.sampler (tier {sampler}: longstraw.sampler) → longstraw.train.trainer (tier {train}: longstraw.train)",
        f"longstraw.tasks.tools (tier {tasks}: longstraw.tasks) → longstraw.agent.rollout (tier {train}: longstraw.agent)"
        " (run by longstraw.agent/__init__.py)",
    ]
    assert unplaced(graph) == ["longstraw.stray"]


#: The test files that stay at the top of `tests/`; every other one lies in `tests/<package>/`, the folder named after
#: the package of `longstraw` it tests (tests/README.md lists them). These hold the public surface and the engine's
#: top-level modules (`api`, `sampler`, `self_check`: no package of their own to mirror), over every
#: family, or the project as a whole (its docs, README, import graph, examples).
TOP_LEVEL_TESTS = {
    # the public surface and the engine
    "test_equivalence.py",
    "test_exact.py",
    "test_bf16.py",
    "test_like_a_user.py",
    "test_errors.py",
    "test_loading.py",
    "test_sampler.py",
    "test_self_check_half.py",
    "test_cuda.py",
    "test_shared_prefix.py",
    "test_ragged.py",
    # the project as a whole
    "test_docs.py",
    "test_readme.py",
    "test_layout.py",
    "test_examples.py",
    "test_trl_examples.py",
    "test_second_pass.py",
}
TESTS = ROOT / "tests"


def test_the_tests_mirror_the_packages():
    """Every folder under `tests/` names a package of `longstraw` at the same path (`tests/ops/` ↔ `longstraw/ops/`)
    and is a package itself (its files import `..conftest`); no test file lies at the top of `tests/` but those of
    `TOP_LEVEL_TESTS`, which all exist; and no two test files share a name, since `tests/conftest.py` gives the
    `numerics` and `multiprocess` markers by file name (every name in its sets is a test file)."""
    from .conftest import MULTIPROCESS, NUMERICS

    folders = sorted(
        d.relative_to(TESTS)
        for d in TESTS.rglob("*")
        if d.is_dir() and not any(p.startswith((".", "_")) for p in d.relative_to(TESTS).parts)
    )
    assert folders, "tests/ has no folder"
    stray = [str(d) for d in folders if not (PACKAGE.joinpath(*d.parts) / "__init__.py").is_file()]
    assert not stray, f"folders of tests/ that name no package of longstraw: {stray}"
    bare = [str(d) for d in folders if not (TESTS.joinpath(*d.parts) / "__init__.py").is_file()]
    assert not bare, f"folders of tests/ without an __init__.py: {bare}"
    loose = sorted(f.name for f in TESTS.glob("test_*.py") if f.name not in TOP_LEVEL_TESTS)
    assert not loose, f"test files at the top of tests/ (move each to the folder of its package): {loose}"
    gone = sorted(TOP_LEVEL_TESTS - {f.name for f in TESTS.glob("test_*.py")})
    assert not gone, f"TOP_LEVEL_TESTS names files that are not at the top of tests/: {gone}"
    files = [f for f in TESTS.rglob("test_*.py") if "__pycache__" not in f.parts]
    names = [f.stem for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"test files of the same name in two folders (markers go by name): {twice}"
    unknown = sorted((NUMERICS | MULTIPROCESS) - set(names))
    assert not unknown, f"tests/conftest.py marks files that do not exist: {unknown}"


def unannotated(names, namespace) -> list[str]:
    """The functions of `names` (and the public methods of its classes) with a parameter or return not annotated."""
    import inspect

    missing = []
    for n in names:
        obj = getattr(namespace, n)
        if inspect.isfunction(obj):
            fns = [(n, obj)]
        elif inspect.isclass(obj):
            fns = [(f"{n}.{k}", v) for k, v in vars(obj).items() if inspect.isfunction(v) and not k.startswith("_")]
        else:
            continue
        for name, f in fns:
            sig = inspect.signature(f)
            params = [
                p
                for p, v in sig.parameters.items()
                if p not in ("self", "cls")
                and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)
                and v.annotation is inspect.Parameter.empty
            ]
            if params or sig.return_annotation is inspect.Signature.empty:
                missing.append(f"{name}{params if params else ''}{'' if params else ' (return)'}")
    return missing


def test_the_public_surface_is_annotated():
    """Every function of `longstraw.__all__` and every public method of its classes names its parameter and return
    types (mypy then checks their bodies and their callers)."""
    import longstraw

    assert not unannotated(longstraw.__all__, longstraw)


def test_the_annotation_check_sees_a_missing_annotation():
    import types

    def typed(x: int) -> int:
        return x

    def untyped(x, y: int):
        return x

    ns = types.SimpleNamespace(typed=typed, untyped=untyped)
    assert unannotated(["typed", "untyped"], ns) == ["untyped['x']"]
