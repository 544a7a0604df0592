"""Equal or refused, per model type: the outcome table of `tests/test_like_a_user.py`, written out.

    python bench/like_a_user.py              # → bench/results/like_a_user.{json,md}

Every tested family (`longstraw.tested_families()`'s tiny configs) and the model types outside the list that the
suite builds (`tests/model/test_support.py`'s `UNTESTED`), each with a `sliding_window` its architecture ignores, a
stray `attention_chunk_size`, eager and sdpa attention, and a registered attention function that changes the math (an
ALiBi-like bias): `longstraw.capture` + `replay` against the unmodified model's full-sequence log-probs (fp32). Each
cell is `equal` (max abs log-prob error ≤ 1e-4, the error given), `refused` (`UnsupportedArchitectureError`), `skip`
(transformers itself refuses the combination, or the unmodified model fails) or `WRONG` / `CRASH` (what must never
happen). One torch thread.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _bench import record  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "like_a_user"


def main() -> None:
    import pytest
    import torch

    import longstraw
    from longstraw.errors import UnsupportedArchitectureError
    from longstraw.model.oracles import full_sequence_logprobs
    from tests import test_like_a_user as t
    from tests.conftest import tie_free_tokens
    from tests.model.test_support import UNTESTED, untested_model

    torch.set_num_threads(1)
    rows: list[dict] = []

    def outcome(build, *args) -> tuple[str, float | None, str]:
        try:
            model = build(*args)
            prompt, response = tie_free_tokens(model, t.P, t.R, seed=5)
            with torch.no_grad():
                ref = full_sequence_logprobs(model, prompt, response)
        except (pytest.skip.Exception, TypeError, ValueError, RuntimeError, KeyError) as err:
            return "skip", None, str(err).split("\n")[0][:200]
        try:
            with torch.no_grad():
                state = longstraw.capture(model, prompt, chunk_size=t.CHUNK)
                got = state.replay(response).logprobs
        except UnsupportedArchitectureError as err:
            return "refused", None, str(err).split("\n")[0][:200]
        except Exception as err:  # noqa: BLE001  (what the table exists to catch)
            return "CRASH", None, f"{type(err).__name__}: {err}"[:200]
        err = (got - ref).abs().max().item()
        return ("equal" if err <= t.FP32_TOL else "WRONG"), err, ""

    cases = [(arch, "tested", lambda a, f, i: t._build(a, f, i)) for arch in t.ARCHS]
    def build_untested(arch, fields, implementation):
        model = untested_model(arch, **fields)
        if implementation is not None:
            model.set_attn_implementation(implementation)
        return model

    cases += [(arch, "untested", build_untested) for arch in UNTESTED]
    for arch, group, build in cases:
        for variant, (fields, implementation, _) in t.VARIANTS.items():
            t0 = time.perf_counter()
            got, err, why = outcome(build, arch, fields, implementation)
            record(rows, dict(model_type=arch, group=group, variant=variant, outcome=got, max_abs_error=err, why=why,
                              seconds=time.perf_counter() - t0), RESULTS)
    RESULTS.with_suffix(".md").write_text(_table(rows) + "\n")
    print(_table(rows))
    bad = [r for r in rows if r["outcome"] in ("WRONG", "CRASH")]
    print(f"\n{len(rows)} cases: " + ", ".join(f"{k} {sum(r['outcome'] == k for r in rows)}"
                                           for k in ("equal", "refused", "skip", "WRONG", "CRASH")))
    if bad:
        raise SystemExit(f"{len(bad)} wrong or crashing cases")


def _table(rows: list[dict]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["| model type | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    by = {(r["model_type"], r["variant"]): r for r in rows}
    for arch in dict.fromkeys(r["model_type"] for r in rows):
        cells = []
        for v in variants:
            r = by[(arch, v)]
            cells.append(r["outcome"] + (f" ({r['max_abs_error']:.0e})" if r["max_abs_error"] is not None else ""))
        group = next(r["group"] for r in rows if r["model_type"] == arch)
        lines.append(f"| `{arch}`{'' if group == 'tested' else ' (untested)'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
