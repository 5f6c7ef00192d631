"""``python -m jupyter_gpulease.worker [--session] [--preload a,b]``: see ``process``."""

from .process import main

main()
