"""``python -m inference.tools.model_prep``: prepare a model without Django (same flags as ``prepare_model``)."""

import sys

from inference.tools.model_prep.cli import main

sys.exit(main())
