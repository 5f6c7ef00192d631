"""What runs in the user's IPython kernel.

- ``magics``: the ``%%gpu`` cell magic and the ``%gpu`` line magic.
- ``api``: the Python API (``lease``, ``on_gpu``, ``map``) for code outside magics.
- ``acquire``: asking for a lease and waiting in the queue, and the heartbeats that keep it.
- ``cellrun``: running code on a lease (the one path of magics, sessions and the API).
- ``sessions``: warm leased workers kept across cells (``--session``).
- ``cellcode``: checks of a cell's code and the choice of its inputs.
"""
