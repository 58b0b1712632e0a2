"""``python -m gpu_check``: the GPU check's driver (:mod:`gpu_check.driver`); ``bash scripts/gpu_check.sh`` runs it."""

import sys

from gpu_check.driver import main

sys.exit(main(sys.argv[1:]))
