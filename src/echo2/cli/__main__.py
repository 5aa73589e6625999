"""``python -m echo2.cli`` (how `echo2 run` starts its local workers, and torchrun a sharded learner's
ranks)."""

import os
import sys

from echo2.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank of a sharded learner: see learner.sharded.leave
    from echo2.learner.sharded import leave

    leave(code)
sys.exit(code)
