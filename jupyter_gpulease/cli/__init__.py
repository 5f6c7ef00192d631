"""The ``gpulease`` command line: ``main`` (the user's commands) and ``admin`` (``gpulease admin ...``)."""
