"""``python -m prefixattn.cli ARGS``: the ``prefixattn`` command from a checkout or without the console script."""

import sys

from prefixattn.cli import main

sys.exit(main())
