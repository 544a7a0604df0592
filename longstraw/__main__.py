"""`python -m longstraw ...` (what `torchrun -m longstraw train CONFIG.yaml` runs on every rank)."""

import sys

from .cli import main

sys.exit(main())
