"""``python -m inference.tools.load_test``: the ``load_test`` console script without its installed wrapper."""

import sys

from inference.tools.load_test.cli import main

sys.exit(main())
