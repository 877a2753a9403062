"""``python3 -m spotguard launch [--] CMD ARGS…``: run a launcher such as torchrun and exit 143
when it failed after this run's checkpoint (see :func:`spotguard.launch`)."""

import sys

from . import main

sys.exit(main())
