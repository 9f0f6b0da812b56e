"""Which "latest checkpoint" claim of a run to believe. Sans-IO.

Why: a record is one writer's signed claim that manifest M is epoch E of run R. Its signature
proves who claims it, not that it is true, and identities are free: a fresh identity that signs
epoch 2**63-1 for a manifest of its own would otherwise be every resume's "latest". The swarm
saves each checkpoint on three peers chosen without a coordinator (``autosave.choose_writers``),
which save the same state and so sign the same (epoch, manifest, size). A claim is believed when

* at least ``quorum`` (default :data:`QUORUM`) distinct writers signed it, or
* a writer the caller trusts signed it (``--trusted-writers``: one record of theirs suffices), or
* the caller itself signed it (its own record is evidence for itself);

the run's latest is the newest believed claim. Newer claims that are not believed are returned as
refused, so that the caller names their writers. What this does not stop: one party running
``quorum`` identities (see docs/threat-model.md); a private swarm or a trusted-writer list does.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from dht import PeerID

from .cid import cid
from .record import CheckpointRecord

#: distinct writers that must sign the same claim for it to be believed without a trusted writer: as many
#: as an epoch's writers (``checkpoint_writers``' default), so two colluding identities are not enough
QUORUM = 3


@dataclass(frozen=True)
class Claim:
    """One (epoch, manifest, size) of a run and every record that claims it."""

    records: tuple[CheckpointRecord, ...]  # newest first, one per writer

    @property
    def record(self) -> CheckpointRecord:
        """The newest of the agreeing records (the one a fetch stores first)."""
        return self.records[0]

    @property
    def writers(self) -> frozenset[PeerID]:
        return frozenset(r.writer for r in self.records)

    def describe(self) -> str:
        r = self.record
        who = ", ".join(sorted(w.short() for w in self.writers))
        return f"checkpoint {cid(r.manifest_id)[:20]} at epoch {r.epoch} (claimed by {who})"


@dataclass(frozen=True)
class Verdict:
    """The believed latest claim (None: none is), why, and the newer claims refused."""

    chosen: Claim | None
    basis: str = ""  # e.g. "agreed by 3 writers", "signed by trusted writer 12D3…"
    refused: tuple[Claim, ...] = field(default=())


def group_claims(records: Iterable[CheckpointRecord | None]) -> list[Claim]:
    """``records`` grouped by what they claim (epoch, manifest, size), newest claim first (by
    :meth:`CheckpointRecord.newer_than` of each group's newest record); one record per writer."""
    groups: dict[tuple[int, bytes, int], dict[PeerID, CheckpointRecord]] = {}
    for r in records:
        if r is None:
            continue
        per_writer = groups.setdefault((r.epoch, r.manifest_id, r.size), {})
        old = per_writer.get(r.writer)
        if r.newer_than(old):
            per_writer[r.writer] = r
    claims = [Claim(tuple(sorted(g.values(), key=lambda r: r._order(), reverse=True))) for g in groups.values()]
    return sorted(claims, key=lambda c: c.record._order(), reverse=True)


def evidence(writers: Collection[PeerID], *, trusted: Collection[PeerID] = (), me: PeerID | None = None,
             quorum: int = QUORUM) -> str | None:
    """Why a claim signed by ``writers`` is believed, or None when it is not."""
    if me is not None and me in writers:
        return "our own record"
    ours = sorted(w.short() for w in writers if w in trusted)
    if ours:
        return f"signed by trusted writer {ours[0]}"
    if len(set(writers)) >= quorum:
        return f"agreed by {len(set(writers))} writers"
    return None


def decide(records: Iterable[CheckpointRecord | None], *, trusted: Collection[PeerID] = (),
           me: PeerID | None = None, quorum: int = QUORUM) -> Verdict:
    """The newest claim among ``records`` that :func:`evidence` believes, and the newer ones it refused."""
    if type(quorum) is not int or quorum < 1:
        raise ValueError(f"quorum must be a positive int, got {quorum!r}")
    refused: list[Claim] = []
    for claim in group_claims(records):
        basis = evidence(claim.writers, trusted=trusted, me=me, quorum=quorum)
        if basis is not None:
            return Verdict(claim, basis, tuple(refused))
        refused.append(claim)
    return Verdict(None, "", tuple(refused))


def refusal(claim: Claim, quorum: int = QUORUM) -> str:
    """One line on why ``claim`` is not believed, and how a user who trusts its writer takes it."""
    writers = sorted(claim.writers)
    return (f"{claim.describe()} is not the run's latest: {len(writers)} writer(s) sign it, {quorum} distinct "
            f"ones must agree (or trust one: --trusted-writers {writers[0]})")


def parse_writers(values: Iterable[str | PeerID]) -> frozenset[PeerID]:
    """PeerIDs from ``--trusted-writers`` values (each may list several, comma- or space-separated);
    ValueError naming the first one that is not a PeerID."""
    if isinstance(values, (str, PeerID)):
        values = [values]
    out: set[PeerID] = set()
    for value in values:
        if isinstance(value, PeerID):
            out.add(value)
            continue
        if not isinstance(value, str):
            raise ValueError(f"a trusted writer is a PeerID string, not {type(value).__name__}")
        out.update(map(PeerID.from_base58, value.replace(",", " ").split()))  # ValueError names a bad one
    return frozenset(out)
