"""The README's test command is what CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```")[0].strip() for b in readme.split("```bash\n")[1:3]]
    demo, test = blocks
    assert demo.endswith("longstraw demo")
    assert test.endswith("python -m pytest -q")
    assert test in (ROOT / ".ci" / "run").read_text()
