"""jupyter-gpulease: the notebook cell, not the notebook, holds the GPU."""

__version__ = "0.1.0"
