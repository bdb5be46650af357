"""Launchers: :func:`spawn` (in-process API) and ``ringcomm run`` (see :mod:`.local`)."""

from ringcomm.launch.spawn import spawn

__all__ = ["spawn"]
