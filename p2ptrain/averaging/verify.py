"""Sans-IO core of the shard audit (:mod:`.audit`): recompute a chunk of an owner's shard by the
round's rule from the members' parts, compare it with the owner's reply, and, when they differ,
tell an owner that cheated from a member that lied to us about its part.

A part is ``(weight, values)``: the weight it counted with at the owner (see
``group.counted_weight``) and its decoded float32 values. Who is believed about a part: its
sender, always (an honest member's part is then exact; a hostile member's part is one of the
hostile rows the rule tolerates, whichever version it shows). The owner's own copies only serve to
attribute a mismatch: an owner that misreports *our* part, or whose reply is not the rule over the
parts it says it combined, cheated; a mismatch explained only by another member's part is a dispute
between that member and the owner which we cannot settle (one of them lied), so nobody is named.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .robust import aggregate

__all__ = ["TOLERANCE", "Part", "Verdict", "agrees", "judge", "recompute"]

Part = tuple[float, torch.Tensor]

#: How far a reply may differ from our recomputation, relative to the chunk's largest magnitude:
#: float rounding (another CPU, another thread count) for a lossless reply, one rounding step of
#: the gather codec otherwise. A cheating owner can move a value by at most this much unseen.
TOLERANCE = {"none": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2, "int8": 2e-2, "int8-outlier": 2e-2}
_DEFAULT_TOLERANCE = 2e-2


def agrees(reply: torch.Tensor, value: torch.Tensor, gather_codec: str) -> bool:
    """``reply`` (the owner's, decoded) is ``value`` (ours) up to the gather codec's rounding."""
    if not value.numel():
        return True
    tol = TOLERANCE.get(gather_codec, _DEFAULT_TOLERANCE) * float(value.abs().max()) + 1e-30
    return bool(((reply - value).abs() <= tol).all())  # (NaN compares false)


def recompute(rule: str, parts: dict[int, Part]) -> torch.Tensor:
    """The rule over ``parts`` (rank -> part), stacked in rank order as the owner stacks them."""
    ranks = sorted(parts)
    x = torch.stack([parts[r][1] for r in ranks])
    w = torch.tensor([parts[r][0] for r in ranks], dtype=torch.float32)
    return aggregate(rule, x, w)


@dataclass
class Verdict:
    """``cheat``: why the owner is named (None: it is not); ``disputed``: members whose part
    differs from the owner's copy of it (when the owner is not named: one of the two lied)."""

    cheat: str | None
    disputed: list[int]


def _same(a: Part, b: Part) -> bool:
    return a[0] == b[0] and a[1].shape == b[1].shape and torch.equal(a[1], b[1])


def judge(rule: str, reply: torch.Tensor, gather_codec: str, contributors: set[int], me: int,
          mine: Part, supplied: dict[int, Part], owner_copies: dict[int, Part] | None) -> Verdict:
    """Attribute a mismatch between ``reply`` and the rule over the parts the members sent us.

    ``contributors``: the ranks the owner reported for this chunk; ``mine``: our own part;
    ``supplied``: the parts other members sent us (as they say they sent them to the owner);
    ``owner_copies``: the parts the owner says it combined (None: it showed none)."""
    if owner_copies is None:
        return Verdict("showed none of the parts its result was made of", [])
    if set(owner_copies) != contributors:
        return Verdict(f"showed parts of ranks {sorted(owner_copies)}, not of the contributors it reported "
                       f"({sorted(contributors)})", [])
    if not _same(owner_copies[me], mine):
        return Verdict("misreported our own part", [])
    if not agrees(reply, recompute(rule, owner_copies), gather_codec):
        return Verdict("its result is not the rule over the parts it says it combined", [])
    return Verdict(None, sorted(r for r, p in supplied.items() if r in owner_copies and not _same(p, owner_copies[r])))
