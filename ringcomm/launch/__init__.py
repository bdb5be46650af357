"""Launchers: :func:`spawn` (in-process API) and ``ringcomm run``.

``ringcomm run`` is :mod:`.cli` (its parser; picks the launcher) over :mod:`.local` (this
host) and :mod:`.ssh` (other hosts), which share :mod:`.supervise` (rank processes, their
output and supervision) and :mod:`.envvars` (the rank variables, ``--env``).
"""

from ringcomm.launch.spawn import spawn

__all__ = ["spawn"]
