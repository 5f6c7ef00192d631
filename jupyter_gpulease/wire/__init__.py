"""Between a kernel and its worker: what both ends import, and nothing of IPython (a worker starts fast).

- ``transfer``: framed messages and out-of-band values between a kernel and its worker.
- ``vmcopy``: direct process-to-process copies of large values (Linux ``process_vm_readv``).
- ``fastpath``: every optimisation of a cell's path that is not plain code (memory faulted in ahead, the timings
  that keep background work off the cell's answer), each with the benchmark figure it buys.

Keep this ``__init__`` empty: every worker start imports it.
"""
