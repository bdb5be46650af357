"""Rendezvous: the key-value store ranks meet at before the data plane exists.

``StoreServer`` serves it (rank 0 or a launcher), ``Store`` is the thread-safe client with
``set/get/try_get/add/wait/delete/check/compare_set`` and ``prefixed()`` namespaces.
"""

from ringcomm.rendezvous.join import JoinRefusedError, JoinRequest
from ringcomm.rendezvous.store import DEFAULT_STORE_TIMEOUT_S, Store, StoreServer

__all__ = ["DEFAULT_STORE_TIMEOUT_S", "JoinRefusedError", "JoinRequest", "Store", "StoreServer"]
