"""The worker process that runs a ``%%gpu`` cell with the leased GPUs visible, and what it needs.

- ``process``: the worker itself, started as ``python -m jupyter_gpulease.worker``.
- ``env``: the environment a worker starts with.
- ``park``: a session worker's state parked in host memory when its lease ends, and loaded back.
- ``held``: what a waiting worker holds for its next job (memory faulted in ahead: ``wire.fastpath``).

What travels between the kernel and its worker, and how, is ``jupyter_gpulease.wire`` (both ends import it).

Nothing here imports IPython or the kernel side: a worker starts fast, and runs on a GPU node
without a kernel. Keep this ``__init__`` empty: every worker start imports it.
"""
