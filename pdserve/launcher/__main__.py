"""``python -m pdserve.launcher``: the same as ``pdserve up``."""

import sys

from pdserve.launcher.cli import main

sys.exit(main())
