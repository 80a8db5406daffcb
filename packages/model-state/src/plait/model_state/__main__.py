"""``python -m plait.model_state``: see :mod:`plait.model_state.cli`."""

import sys

from .cli import main

sys.exit(main())
