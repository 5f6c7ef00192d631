"""What the notebook side and the broker agree on, with no dependency beyond the standard library.

- ``gpulease_protocol.requests``: the syntax of a lease request's GPU count, durations and sizes
  (one set of rules: the broker validates request bodies with them, the client checks what a user typed).
- ``gpulease_protocol.address``: where a broker listens, where a client looks for one, and the token it presents.
- ``gpulease_protocol.entry_points``: ``EntryPointType``, the option that picks a class by entry-point name (an
  inventory, an executor); the one module that needs more than the standard library: traitlets, which both halves
  are configured with.
- ``gpulease_protocol.ray_ids``: the Ray task that says which GPU IDs Ray assigned to a bundle of a lease's placement
  group, and how it is placed in the bundle (the broker runs it once a group is placed, a kernel where the lease view
  does not carry the IDs); it imports ``ray`` only inside its functions.

Both ``lease_broker`` and ``jupyter_gpulease`` import this package; it imports neither.
"""
