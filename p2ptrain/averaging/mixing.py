"""Sans-IO mixing groups (Moshpit-style): which part of the swarm a peer averages with in a round.

Once the swarm outgrows ``target`` peers, peers sit in a grid of ``d`` dimensions whose sides
are powers of two of at most ``target``, with as many cells as the swarm's size rounded to a power
of two. Round ``k`` averages along dimension ``k mod d``: peers that share every other coordinate
meet under one matchmaking key, one side's worth of them, so no peer ever reads more than a cell
of the swarm, and each cell of a dimension draws one peer from each group of the one before: in a
full grid ``d`` rounds give every peer the exact average of all.

A peer's coordinates are its index among the swarm's peers sorted, drawn anew each round from the
swarm it sees: peers that see the same swarm place it alike, and nothing a round did (a group
formed short, a peer late or loading state) carries over into the next. Coordinates taken from
group ranks instead drifted: a peer left over from a full group kept a coordinate another took,
and its cells held 5 and 3 of 4 for good (a quarter of the cells of a 64-peer swarm within a few
rounds).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence


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
    in a swarm of ``peers`` (``""`` when the whole swarm is one group), ``expected(k, peers)`` how
    many of ``peers`` (us included) that cell holds."""

    def __init__(self, me: bytes, target: int) -> None:
        if target < 1:
            raise ValueError("target group size must be at least 1")
        self.me = bytes(me)
        self.target = target
        #: the peers last placed: the grid, every peer sorted (us included), our index among them
        self._placed: tuple[tuple[bytes, ...], tuple[int, ...], list[bytes], int] | None = None

    def shape(self, n: int) -> tuple[int, ...]:
        """The grid's sides for a swarm of about ``n`` peers (see :func:`swarm_size`)."""
        return grid_shape(swarm_size(n), self.target)

    def _place(self, peers: Sequence[bytes]) -> tuple[tuple[int, ...], list[bytes], int]:
        """The grid for ``peers``, every peer it holds sorted (us included) and our index among them."""
        key = tuple(peers)
        if self._placed is None or self._placed[0] != key:
            everyone = sorted(set(key) | {self.me})
            self._placed = key, self.shape(len(key)), everyone, everyone.index(self.me)
        return self._placed[1:]

    def key(self, k: int, peers: Sequence[bytes]) -> str:
        """The cell of round ``k``: the grid's shape, the dimension averaged along, and our other
        coordinates (appended to the round id by the caller)."""
        shape, _, index = self._place(peers)
        if not shape:
            return ""
        dim = k % len(shape)
        rest = ".".join(str(c) for j, c in enumerate(coords(index, shape)) if j != dim)
        return f"/g{'x'.join(map(str, shape))}d{dim}:{rest}"

    def expected(self, k: int, peers: Sequence[bytes], coming: Collection[bytes] | None = None) -> int | None:
        """How many of ``peers`` (us included; only those in ``coming``, when given) round ``k``'s
        cell holds; None without a grid."""
        cell = self.members(k, peers)
        if cell is None:
            return None
        return 1 + sum(1 for p in cell if p != self.me and (coming is None or p in coming))

    def members(self, k: int, peers: Sequence[bytes]) -> list[bytes] | None:
        """The peers of ``peers`` that round ``k``'s cell holds (us included); None without a grid."""
        shape, everyone, index = self._place(peers)
        if not shape:
            return None
        dim = k % len(shape)

        def rest(i: int) -> list[int]:
            return [c for j, c in enumerate(coords(i, shape)) if j != dim]

        ours = rest(index)
        return [p for i, p in enumerate(everyone) if i == index or rest(i) == ours]


def coords(index: int, shape: Sequence[int]) -> list[int]:
    """The coordinates of the ``index``-th peer (mixed radix: consecutive indices differ in the
    first; a swarm larger than the grid wraps around it)."""
    out = []
    for side in shape:
        index, c = divmod(index, side)
        out.append(c)
    return out
