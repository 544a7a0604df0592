"""`python -m longstraw ...` (what `torchrun -m longstraw train CONFIG.yaml` runs on every rank).

A rank of a multi-process run (WORLD_SIZE > 1) ends with `os._exit` once its work is done and its output flushed, as
the workers of Python's own `multiprocessing` do. Its process group is destroyed by then (`Ranks.close`), but torch
objects that outlive that call (the sharded model's device mesh, FSDP2's state) still hold gloo's C++ process group,
whose worker and transport threads interpreter finalization would then tear down in no fixed order: that has aborted
a finished rank (SIGABRT, "terminate called without an active exception") and so left the other machines' torchrun
agents waiting for it in their exit barrier. A single process exits normally."""

import os
import sys
import traceback

from .cli import main

if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
    sys.exit(main())
code: str | int | None
try:
    code = main()
except SystemExit as err:
    code = err.code
except BaseException:  # noqa: BLE001 (printed as the interpreter would, then the same exit status 1)
    traceback.print_exc()
    code = 1
if code is None:
    code = 0
elif not isinstance(code, int):
    print(code, file=sys.stderr)
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
