"""``python -m kvmem.cli``: the ``kvmem`` command without its console script."""

import sys

from kvmem.cli import main

sys.exit(main())
