"""Transport: the wire format (pure pack/unpack) and the ZeroMQ sockets.

This package is the only place in ringcomm that imports ``zmq``; every layer above it
(rendezvous, group, collectives, ...) goes through the classes exported from here.
"""
