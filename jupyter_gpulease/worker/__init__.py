"""The worker process that runs a ``%%gpu`` cell with the leased GPUs visible, and what it needs.

- ``process``: the worker itself, started as ``python -m jupyter_gpulease.worker``.
- ``transfer``: framed messages and out-of-band values between a kernel and its worker (both sides).
- ``vmcopy``: direct process-to-process copies of large values (Linux ``process_vm_readv``).
- ``env``: the environment a worker starts with.
- ``park``: a session worker's state parked in host memory when its lease ends, and loaded back.

Nothing here imports IPython or the kernel side: a worker starts fast, and runs on a GPU node
without a kernel. Keep this ``__init__`` empty: every worker start imports it.
"""
