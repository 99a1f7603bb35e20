"""Collectives: the backend's own, and explicit algorithms on send/recv, behind one ``Comm`` layer."""

from shardwise.collectives.api import Comm, CommStats, Work

__all__ = ["Comm", "CommStats", "Work"]
