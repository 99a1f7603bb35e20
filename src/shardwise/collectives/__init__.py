"""Collectives: the backend's own, and explicit algorithms on send/recv, behind one ``Comm`` layer."""

from shardwise.collectives.api import Comm, CommStats, Work
from shardwise.collectives.cost import CostProfile, choose, predict
from shardwise.collectives.explicit import ALGORITHM_FOR, EXPLICIT
from shardwise.collectives.p2p import P2P

__all__ = [
    "ALGORITHM_FOR",
    "EXPLICIT",
    "P2P",
    "Comm",
    "CommStats",
    "CostProfile",
    "Work",
    "choose",
    "predict",
]
