"""``python -m echo2.cli`` (how `echo2 run` starts its local workers)."""

import sys

from echo2.cli import main

sys.exit(main())
