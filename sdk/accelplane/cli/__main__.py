"""``python -m accelplane.cli``: the ``accelplane`` command."""

import sys

from accelplane.cli import main

sys.exit(main())
