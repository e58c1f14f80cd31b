"""``python -m eventflow.cli``: the same as the ``eventflow`` command."""

import sys

from . import main

sys.exit(main())
