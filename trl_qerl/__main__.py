"""``python -m trl_qerl``: the ``trl-qerl`` command."""

import sys

from .cli import main


sys.exit(main())
