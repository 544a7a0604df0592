"""The commands of the command line (`longstraw.cli` parses the arguments and dispatches to them).

- `training`: `longstraw train` and `longstraw eval`, and `run_training` (train, evaluate, plot) that the demos share;
- `demo`: `longstraw demo` and `longstraw demo --real`, their built-in configs;
- `tools`: `longstraw compare`, `check`, `plan` and `real`;
- `flags`: every `TrainConfig` field as a flag, read back as the field's type.
"""
