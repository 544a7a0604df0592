"""The recipe in examples/ runs, learns, and uses nothing of longstraw but its public surface."""

import ast
import importlib.util
from pathlib import Path

RECIPE = Path(__file__).parent.parent / "examples" / "grpo_long_prompt.py"


def test_recipe_uses_only_the_public_surface():
    tree = ast.parse(RECIPE.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in modules if m.startswith("longstraw")} == {"longstraw", "longstraw.losses"}
    calls = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert {"capture", "sample", "replay", "backward", "normalizer", "response_loss"} <= calls


def test_recipe_learns_its_reward_on_long_prompts():
    spec = importlib.util.spec_from_file_location("grpo_long_prompt", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    rewards = recipe.main(steps=12, prompt_length=512, num_generations=8, max_new_tokens=8)
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.6, rewards


def test_trl_quickstart_runs_with_longstraws_import(tmp_path):
    """The TRL-shaped script (examples/trl_quickstart.py) on the tiny model: 4 questions of a document over 2 steps,
    its state captured once and reused (`recapture_every: 2`), each step's 2 rows reading the document once (the shared
    fraction's bound with 2 rows is 1/2, less each row's own few-token question)."""
    spec = importlib.util.spec_from_file_location("trl_quickstart", RECIPE.parent / "trl_quickstart.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = script.main(model="llama", length=40, steps=2, output_dir=str(tmp_path / "run"))
    assert [(m["state_captures"], m["state_reuses"], m["prompt_shared_frac"] > 0.45) for m in out] == [
        (1, 0, True),
        (0, 1, True),
    ]
