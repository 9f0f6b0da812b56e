"""Sans-IO mixing groups (Moshpit-style): which part of the swarm a peer averages with in a round.

Once the swarm outgrows ``target`` peers, peers sit in a ``d``-dimensional grid of side ``s``
(the smallest ``d`` with ``target ** d >= n``, the smallest ``s`` with ``s ** d >= n``). Round ``k``
averages along dimension
``k mod d``: peers that share every other coordinate meet under one matchmaking key, about ``s``
of them, so no peer ever reads more than a cell of the swarm. After a round a peer takes its rank
in its group as its coordinate along that dimension, so the next dimension's cells draw one peer
from each of the last round's groups: in a full grid ``d`` rounds give every peer the exact
average of all, and any round mixes what separate groups averaged before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def swarm_size(n: int) -> int:
    """``n`` rounded to the nearest power of two in log scale: peers whose counts of the swarm
    differ by a few still agree on its grid (a grid changes only where the swarm doubles)."""
    if n <= 1:
        return 1
    return 1 << round(math.log2(n))


def grid_shape(n: int, target: int) -> tuple[int, int]:
    """``(dims, side)`` of the grid for a swarm of ``n`` peers and groups of about ``target``;
    ``(0, n)`` while one group holds everyone."""
    if target < 1:
        raise ValueError("target group size must be at least 1")
    if n <= target or target == 1:
        return 0, n
    dims = 1
    while target ** dims < n:
        dims += 1
    side = 2
    while side ** dims < n:
        side += 1
    return dims, side


class GridMixer:
    """One peer's place in the grid: ``key(k, peers)`` names the cell it averages in at round ``k``
    in a swarm of ``peers`` (``""`` when the whole swarm is one group), ``placed(k, peers, rank)``
    records its rank in the group it got. A new grid places peers by their index among ``peers``
    sorted (every peer that sees the same swarm places it alike, each cell full); from then on by rank."""

    def __init__(self, me: bytes, target: int) -> None:
        if target < 1:
            raise ValueError("target group size must be at least 1")
        self.me = bytes(me)
        self.target = target
        self._shape: tuple[int, int] = (0, 0)
        self.coords: list[int] = []

    def shape(self, n: int) -> tuple[int, int]:
        """The grid's ``(dims, side)`` for a swarm of about ``n`` peers (see :func:`swarm_size`)."""
        return grid_shape(swarm_size(n), self.target)

    def _place(self, shape: tuple[int, int], peers: Sequence[bytes]) -> list[int]:
        if shape != self._shape:
            dims, side = shape
            self._shape = shape
            ordered = sorted(set(peers) | {self.me})
            index = ordered.index(self.me)
            self.coords = [(index // side ** j) % side for j in range(dims)]
        return self.coords

    def key(self, k: int, peers: Sequence[bytes]) -> str:
        """The cell of round ``k``: the grid's shape, the dimension averaged along, and our other
        coordinates (appended to the round id by the caller)."""
        shape = self.shape(len(peers))
        dims, side = shape
        if not dims:
            return ""
        coords = self._place(shape, peers)
        dim = k % dims
        rest = ".".join(str(c) for j, c in enumerate(coords) if j != dim)
        return f"/g{dims}x{side}d{dim}:{rest}"

    def placed(self, k: int, peers: Sequence[bytes], rank: int) -> None:
        """After round ``k``: our rank in its group becomes our coordinate along its dimension."""
        shape = self.shape(len(peers))
        dims, side = shape
        if dims and rank >= 0:
            self._place(shape, peers)[k % dims] = rank % side


def rank_in(members: Sequence[object], me: object) -> int:
    """Our index in a group's ordered member list (-1 when absent)."""
    try:
        return list(members).index(me)
    except ValueError:
        return -1
