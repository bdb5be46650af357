"""Large payloads between ranks on one host through shared memory, not the socket.

The sender copies a piece once into a slot of a segment it shares with the receiver, which
reduces or copies straight out of it; the zmq message carries the header and a 16-byte
reference (slot, generation, length) instead of the payload, so message order, matching and
fingerprints are those of the socket path. One anonymous ``memfd`` segment per ordered pair,
handed over the same-host lane socket (``SCM_RIGHTS``): nothing left behind when a rank dies.

Invariants: a receiver takes a slot only if its state byte still holds the reference's
generation (a duplicate or stale reference is refused); a slot is free again only once the
last view of the received payload is gone; no free slot, or a larger piece: the socket.
Plain state-byte stores rely on x86-64's TSO, so the lane is used only there
(``AVAILABLE``). Slot life: docs/architecture.md, section "transport/shm_lane.py".
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import weakref
from typing import Any

import numpy as np

__all__ = ["AVAILABLE", "REF_BYTES", "SHM_TAG", "ShmSegments", "is_ref"]

#: x86-64 Linux with memfd (module docstring: the slot protocol relies on TSO).
AVAILABLE = (
    hasattr(os, "memfd_create")
    and hasattr(os, "MFD_CLOEXEC")
    and platform.machine().lower() in ("x86_64", "amd64")
)
#: What a lane datagram carrying a segment's descriptor starts with (then the sender rank).
SHM_TAG = b"ringcomm-shm-v1:"
_REF = struct.Struct("<4sIHHI")  # magic, sender rank, slot, generation, length
_MAGIC = b"RCS1"
_TAKEN = 255  # a slot's state once the receiver took its piece (generations are 1..254)
REF_BYTES = _REF.size
#: Default slot size: the default piece size (group.DEFAULT_CHUNK_BYTES), so pieces fit.
DEFAULT_SLOT_BYTES = 4 << 20
DEFAULT_SLOTS = 4
_HEADER_BYTES = 4096  # the state bytes, padded to a page


def is_ref(frame: Any) -> bool:
    """Whether a payload frame is a slot reference (real payload frames are never this
    short: anything below 4 KiB travels inline in its header)."""
    return len(frame) == REF_BYTES and bytes(frame[:4]) == _MAGIC


def _free(segment: mmap.mmap, slot: int, generation: int) -> None:
    try:
        if segment[slot] == generation:
            segment[slot] = 0
    except ValueError:
        pass  # closed: nobody sends into it any more


class _Segment:
    def __init__(self, fd: int, slots: int, slot_bytes: int) -> None:
        self.fd = fd
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.map = mmap.mmap(fd, _HEADER_BYTES + slots * slot_bytes)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a received payload still views it: freed with the last view
        try:
            os.close(self.fd)
        except OSError:
            pass


class ShmSegments:
    """This rank's outgoing segments (one per peer it sends to) and incoming ones."""

    def __init__(
        self, rank: int, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES
    ) -> None:
        self.rank = rank
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._out: dict[int, _Segment] = {}
        self._in: dict[int, _Segment] = {}
        self.sent = 0  # pieces sent through a slot
        self._generation = 0  # of the last piece put (1..255, in the slot's state byte)
        self.full = 0  # pieces that found no free slot (sent through the socket)

    # -- setup -------------------------------------------------------------------------
    def outgoing_fd(self, peer: int) -> int:
        """The descriptor of our segment towards ``peer`` (created on first call)."""
        seg = self._out.get(peer)
        if seg is None:
            fd = os.memfd_create(f"ringcomm-r{self.rank}-to-r{peer}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, _HEADER_BYTES + self.slots * self.slot_bytes)
                seg = _Segment(fd, self.slots, self.slot_bytes)
            except OSError:
                os.close(fd)
                raise
            self._out[peer] = seg
        return seg.fd

    def attach(self, peer: int, fd: int, size: int) -> bool:
        """Map ``peer``'s segment towards us (``fd``, ``size`` bytes as it says); False
        (descriptor closed) if its layout is not ours."""
        if peer in self._in or size != _HEADER_BYTES + self.slots * self.slot_bytes:
            os.close(fd)
            return False
        try:
            if os.fstat(fd).st_size != size:
                os.close(fd)
                return False
            self._in[peer] = _Segment(fd, self.slots, self.slot_bytes)
        except OSError:
            os.close(fd)
            return False
        return True

    def segment_bytes(self) -> int:
        return _HEADER_BYTES + self.slots * self.slot_bytes

    # -- data --------------------------------------------------------------------------
    def put(self, peer: int, payload: Any, nbytes: int) -> bytes | None:
        """Copy ``payload`` into a free slot of our segment towards ``peer`` and return
        the reference to send; None (nothing done) if there is no segment, no free slot,
        or the piece is larger than a slot."""
        seg = self._out.get(peer)
        if seg is None or nbytes > seg.slot_bytes:
            return None
        state = seg.map
        for slot in range(seg.slots):
            if state[slot] == 0:
                break
        else:
            self.full += 1
            return None
        start = _HEADER_BYTES + slot * seg.slot_bytes
        dst = np.frombuffer(seg.map, np.uint8, nbytes, start)
        np.copyto(dst, np.frombuffer(payload, np.uint8, nbytes))
        generation = self._generation = self._generation % (_TAKEN - 1) + 1
        state[slot] = generation
        self.sent += 1
        return _REF.pack(_MAGIC, self.rank, slot, generation, nbytes)

    def take(self, ref: Any, src: int) -> memoryview | None:
        """The payload a reference from rank ``src`` points at, as a read-only view whose
        last release frees the slot; None for a reference that is not valid."""
        try:
            magic, sender, slot, generation, nbytes = _REF.unpack(ref)
        except struct.error:
            return None
        seg = self._in.get(src)
        if (
            magic != _MAGIC
            or sender != src
            or seg is None
            or slot >= seg.slots
            or nbytes > seg.slot_bytes
            or generation == 0
            or seg.map[slot] != generation
        ):
            return None
        view = np.frombuffer(seg.map, np.uint8, nbytes, _HEADER_BYTES + slot * seg.slot_bytes)
        view.flags.writeable = False
        seg.map[slot] = _TAKEN  # a second reference to the same piece is refused
        weakref.finalize(view, _free, seg.map, slot, _TAKEN)
        return view.data  # the same read-only view: the finalizer fires when it is gone

    def close(self) -> None:
        for seg in (*self._out.values(), *self._in.values()):
            seg.close()
        self._out.clear()
        self._in.clear()
