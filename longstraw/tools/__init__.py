"""Tools above the trainer, each behind a `longstraw` command: the memory planner (`planner.py`, `longstraw plan`),
one GRPO step three ways (`compare.py`, `longstraw compare`), the project's real models (`real_models.py`,
`longstraw real`).
"""
