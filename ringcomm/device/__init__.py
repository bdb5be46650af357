"""The device side: arrays that live on a GPU (CuPy) or stand in for one, and how their
bytes are staged through host buffers.

- :mod:`~ringcomm.device.xp` -- the array module of an array (NumPy or CuPy); the only
  module of ringcomm that imports cupy (base layer);
- :mod:`~ringcomm.device.standin` -- a host array that behaves like a device array, so every
  device path runs and is tested without a GPU (base layer);
- :mod:`~ringcomm.device.staging` -- pinned host staging buffers and the copy/send overlap
  (beside the group core);
- :mod:`~ringcomm.device.p2p` -- send and receive of device arrays, staged piece by piece
  (beside the point-to-point operations).

Nothing is imported here: each module is imported by its own layer.
"""
