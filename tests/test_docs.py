"""The documentation: every file and link it names exists, its commands are the CLI's, and the README stays short."""

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
        ROOT / "tests" / "README.md", ROOT / "CHANGELOG.md"]
#: a repository path in backticks: `longstraw/prompt_state.py`, `bench/results/x.{json,md}`, `tests/test_x.py::test_y`
PATH = re.compile(r"`((?:longstraw|bench|tests|docs|examples|csrc|\.ci)/[^`\s]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _expand(path: str) -> list[str]:
    """`a.{json,md}` → a.json, a.md."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(path: str) -> bool:
    path = path.split("::")[0].rstrip(".,:;")
    return any(ROOT.glob(p) if "*" in p else (ROOT / p).exists() for p in _expand(path))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_link_in_the_docs_exists(doc):
    text = doc.read_text()
    # the changelog names the paths of its time (modules moved since): its links are checked, not its paths
    paths = [] if doc.name == "CHANGELOG.md" else PATH.findall(text)
    missing = [p for p in paths if not _exists(p)]
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_readme_is_short_and_maps_every_module():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 250
    package = ROOT / "longstraw"
    unmapped = []
    for module in sorted(package.rglob("*.py")):
        rel = module.relative_to(package)
        if len(rel.parts) == 1:
            named = f"`longstraw/{rel}`" in readme
        elif rel.parts[0] == "archs":
            named = module.stem in readme.split("`longstraw/archs/`")[1].split("\n")[0] or module.stem == "__init__"
        else:
            listed = module.stem == "__init__" or f"`{rel.name}`" in readme
            named = f"`longstraw/{rel.parts[0]}/`" in readme and listed
        if not named:
            unmapped.append(str(rel))
    assert not unmapped, f"the README's map of the code misses {unmapped}"


def test_the_commands_in_the_docs_are_the_clis():
    import longstraw.cli as cli

    source = Path(cli.__file__).read_text()
    commands = set(re.findall(r'sub\.add_parser\(\s*"([a-z]+)"', source))
    used = set()
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.splitlines():
                words = line.split("&&")[-1].split()
                if len(words) >= 2 and words[0] == "longstraw":
                    used.add(words[1])
    assert used and used <= commands, f"commands in the docs that the CLI does not have: {used - commands}"


def test_the_models_page_lists_every_tested_family():
    import longstraw

    page = (ROOT / "docs" / "models.md").read_text()
    missing = [name for name in longstraw.tested_families() if f"`{name}`" not in page]
    assert not missing


def test_the_package_passes_the_linter():
    """`ruff check longstraw` with the project's rules (pyproject.toml `[tool.ruff]`)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "longstraw", "--output-format", "concise"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_package_is_formatted():
    """`ruff format --check longstraw`: the package is as the formatter writes it (pyproject.toml `[tool.ruff]`)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", "longstraw"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
