"""``python -m bigfleet``: the ``bigfleet`` command, for environments without the console script."""

import sys

from bigfleet.cli.main import main

sys.exit(main())
