"""``python -m jupyter_gpulease.cli``: the ``gpulease`` command."""

import sys

from .main import main

sys.exit(main())
