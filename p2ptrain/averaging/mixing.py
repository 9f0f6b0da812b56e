"""Sans-IO mixing groups (Moshpit-style): which part of the swarm a peer averages with in a round.

Once the swarm outgrows ``target`` peers, peers sit in a grid of ``d`` dimensions whose sides
are powers of two of at most ``target``, with as many cells as the swarm's size rounded to a power
of two. Round ``k`` averages along dimension ``k mod d``: peers that share every other coordinate
meet under one matchmaking key, one side's worth of them, so no peer ever reads more than a cell
of the swarm. After a round a peer takes its rank in its group as its coordinate along that
dimension, so the next dimension's cells draw one peer from each of the last round's groups: in
a full grid ``d`` rounds give every peer the exact average of all, and any round mixes what
separate groups averaged before. A group short of its cell's size (a peer came late, or alone)
keeps its coordinates: its ranks would put two peers on one coordinate and none on another, and
the cells would drift further out of balance at every round.
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


def grid_shape(n: int, target: int) -> tuple[int, ...]:
    """The sides of the grid for a swarm of ``n`` peers (a power of two) and groups of at most
    ``target``: powers of two, as even as can be, whose product is ``n``; ``()`` while one group
    holds everyone."""
    if target < 1:
        raise ValueError("target group size must be at least 1")
    per_dim = int(math.log2(target)) if target > 1 else 0  # bits of one side
    if n <= target or per_dim == 0:
        return ()
    bits = max(0, math.ceil(math.log2(n)))
    dims = math.ceil(bits / per_dim)
    return tuple(1 << (bits // dims + (1 if j < bits % dims else 0)) for j in range(dims))


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
        self._shape: tuple[int, ...] = ()
        self.coords: list[int] = []

    def shape(self, n: int) -> tuple[int, ...]:
        """The grid's sides for a swarm of about ``n`` peers (see :func:`swarm_size`)."""
        return grid_shape(swarm_size(n), self.target)

    def _place(self, shape: tuple[int, ...], peers: Sequence[bytes]) -> list[int]:
        if shape != self._shape:
            self._shape = shape
            index = sorted(set(peers) | {self.me}).index(self.me)
            self.coords = []
            for side in shape:  # (mixed radix: consecutive indices differ in the first coordinate)
                index, c = divmod(index, side)
                self.coords.append(c)
        return self.coords

    def key(self, k: int, peers: Sequence[bytes]) -> str:
        """The cell of round ``k``: the grid's shape, the dimension averaged along, and our other
        coordinates (appended to the round id by the caller)."""
        shape = self.shape(len(peers))
        if not shape:
            return ""
        coords = self._place(shape, peers)
        dim = k % len(shape)
        rest = ".".join(str(c) for j, c in enumerate(coords) if j != dim)
        return f"/g{'x'.join(map(str, shape))}d{dim}:{rest}"

    def expected(self, k: int, peers: Sequence[bytes]) -> int | None:
        """How many peers round ``k``'s cell holds when ``peers`` fill the grid exactly (placement
        keeps a full grid's cells full); None otherwise (cells then differ)."""
        shape = self.shape(len(peers))
        return shape[k % len(shape)] if shape and math.prod(shape) == len(set(peers) | {self.me}) else None

    def placed(self, k: int, peers: Sequence[bytes], rank: int, size: int) -> None:
        """After round ``k``, in a group of ``size``: our rank in it becomes our coordinate along
        its dimension, when the group filled its cell (else the coordinates stay)."""
        shape = self.shape(len(peers))
        if shape and 0 <= rank < size and size >= shape[k % len(shape)]:
            self._place(shape, peers)[k % len(shape)] = rank % shape[k % len(shape)]


def rank_in(members: Sequence[object], me: object) -> int:
    """Our index in a group's ordered member list (-1 when absent)."""
    try:
        return list(members).index(me)
    except ValueError:
        return -1
