"""Training state between peers: serve ours, load the swarm's (late join, missed rounds).

Each optimizer serves its *shared* state (what every peer of a group holds identically: the
parameters, the inner optimizer state in ``sync`` mode, the outer parameters and optimizer in
``diloco`` mode, the epoch) under ``{run_id}/state``, read from its live tensors. The manifest is
hashed lazily, when a peer asks and the state changed since the last one.
Since the peers of one epoch hold bit-identical state, their manifests have the same content
address and a joiner downloads disjoint chunks from several of them at once, each chunk verified
against the manifest most of them agree on (:mod:`p2ptrain.checkpoint.probe`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from dht import Host

from ..checkpoint import FetchResult, Manifest, StateServer, StateTransferError, fetch_state
from ..checkpoint.manifest import layout
from ..checkpoint.placement import Placement, tensors_under
from ..checkpoint.tree import flatten, tensor_specs
from ..checkpoint.live import LiveSource, StateLock, StateMoved
from ..checkpoint.state_protocol import Provider
from .progress import PeerReport

log = logging.getLogger("p2ptrain.optim.state")

#: how many peers a joiner downloads from at once
MAX_PROVIDERS = 4


class NoProviders(StateTransferError):
    """No peer serves a state as advanced as the one asked for."""


class UntrustedState(StateTransferError):
    """The providers served a state not to believe: labelled outside the epochs asked for, or
    named by no majority of them."""


class StateSync:
    """Serves ``state()`` (returns ``(epoch, nested state)``, called with the lock held) from the
    live tensors it returns (:mod:`p2ptrain.checkpoint.live`) and fetches other peers' state.

    ``lock``: a :class:`~p2ptrain.checkpoint.live.StateLock`, which the training thread holds
    while it changes the state; its acquisitions preserve a version a peer is downloading before
    it changes. ``version()`` (read with the lock held) changes whenever the state does (default:
    the epoch). The epoch alone is not enough to tell: a state-averaging round changes the
    parameters and leaves the epoch as it was, and a state cached by epoch then served the state
    from before that round to every joiner of the epoch."""

    def __init__(self, host: Host, key: str, state: Callable[[], tuple[int, Any]], lock: StateLock | threading.Lock,
                 *, settled: threading.Event | None = None, settle_timeout: float = 5.0,
                 version: Callable[[], Any] | None = None):
        self.host = host
        self.key = key
        self._state = state
        self._raw: threading.Lock = lock.raw if isinstance(lock, StateLock) else lock
        if isinstance(lock, StateLock):
            lock.before_change = self._before_change
        #: set while no round is in flight: a manifest waits for it (at most ``settle_timeout``),
        #: so a joiner gets the state of the epoch about to start, not of one whose round is closing
        self._settled = settled
        self.settle_timeout = settle_timeout
        self._version = version or (lambda: self._state()[0])
        self._served: tuple[int, Any] | None = None  # (epoch, version) of the source served
        # the versions served that a peer may still read (the latest last): the trainer preserves them
        self._live: tuple[LiveSource, ...] = ()
        self._live_lock = threading.Lock()  # (``_live`` changes on the event loop and the trainer's thread)
        self.server = StateServer(host)
        #: bytes of our own state as ``update_size`` last measured it (0: not yet): what a state load moves
        self.size = 0

    async def start(self) -> None:
        await self.server.start()
        self.server.provide(self.key, self._refresh)

    async def close(self) -> None:
        await self.server.close()
        with self._live_lock:
            for src in self._live:
                src.evict()
            self._live = ()

    def state_bytes(self) -> int:
        """The size of the state now (call with the lock held)."""
        _, state = self._state()
        skeleton, _ = flatten(state)
        return layout(tensor_specs(skeleton))[1]

    def update_size(self) -> None:
        """Measure the state's size (``size``); call from the training thread after updates."""
        with self._raw:
            self.size = self.state_bytes()

    @property
    def held_bytes(self) -> int:
        """Bytes of state copies held for peers downloading a version that changed since."""
        return sum(src.held_bytes for src in self._live)

    def _before_change(self) -> None:
        """(The lock held, the state about to change.) Preserve the versions peers download; forget
        those nobody can read any more."""
        with self._live_lock:
            for src in self._live:
                src.preserve()
                src.expire()
            self._live = tuple(s for s in self._live if s.readable)

    async def _refresh(self) -> None:
        """Serve the state as it is now if it changed since the last source (a peer asked)."""
        loop = asyncio.get_running_loop()

        def take() -> tuple[tuple[int, Any], LiveSource] | None:
            if self._settled is not None:
                self._settled.wait(self.settle_timeout)
            with self._raw:
                if (self._state()[0], self._version()) == self._served and self._live:
                    self._live[-1].lease()
                    return None
            seen: dict[str, Any] = {}

            def read() -> Any:  # (the lock held)
                seen["epoch"], state = self._state()
                return state

            for _ in range(3):
                src = LiveSource(self._raw, read, self._version)
                src.lease()
                with self._live_lock:  # from now on a change preserves it: the hashing reads one version
                    self._live = (*self._live, src)
                try:
                    src.describe({"epoch": seen["epoch"]})
                except StateMoved:  # (it changed before we listed it)
                    continue
                return (seen["epoch"], src.version), src
            raise StateMoved("the state changed under every attempt to describe it")

        result = await loop.run_in_executor(None, take)
        if result is None:
            return
        self._served, src = result
        self.server.publish_source(self.key, src)
        # the previous version goes unless a download still reads it
        self.server.drop_idle(self.key)

    @staticmethod
    def choose(peers: list[PeerReport], quorum: bool = False) -> list[PeerReport]:
        """Up to ``MAX_PROVIDERS`` of the most advanced ``peers`` that serve (have an address).

        ``quorum`` (robust rules): the most advanced epoch that two or more of them serve, when
        one does, so that their manifests can be compared: a lone peer ahead is not enough."""
        serving = [p for p in peers if p.reach]
        if not serving:
            return []
        counts = collections.Counter(p.epoch for p in serving)
        shared = [e for e, n in counts.items() if n >= 2]
        best = max(shared) if quorum and shared else max(counts)
        candidates = [p for p in serving if p.epoch == best]
        random.shuffle(candidates)
        return candidates[:MAX_PROVIDERS]

    async def fetch(self, providers: list[PeerReport], timeout: float,
                    into: dict[str, list[torch.Tensor]] | None = None, *, at_least: int = 0,
                    strict: bool = False, max_total: int | None = None,
                    newest: Callable[[], Awaitable[int]] | None = None) -> FetchResult:
        """Download the state most of ``providers`` hold, from all of them at once.

        Its epoch label is a claim too: it must lie between ``at_least`` and the epoch the
        providers report (already judged, see ``claims``; providers describe their state when asked, so a
        label past that is checked against ``newest()``, the newest epoch believed now), and with
        ``strict`` a strict majority of
        two or more providers must name its manifest. Else StateTransferError, naming them.
        ``max_total``: the most bytes a state of ours can take; a larger manifest is refused
        before anything is allocated (default: the transfer's own ceiling).

        ``into``: top-level key of the state -> our tensors of that list (e.g. ``{"params":
        parameters}``): their bytes are written straight into them as chunks land, and the
        restored state holds those very tensors (see ``checkpoint.placement``: no fresh buffer to
        fault in for them, but a fetch that fails leaves them part old, part new)."""
        wire: list[Provider] = [(p.peer, p.reach) for p in providers]

        def place(m: Manifest) -> Placement:  # (only with ``into``)
            assert into
            targets: dict[int, torch.Tensor] = {}
            for key, ours in into.items():
                indices = tensors_under(m.skeleton, key)
                if len(indices) == len(ours):
                    targets.update(zip(indices, ours))
            placement = Placement(m, targets)
            if len(placement.placed) != sum(map(len, into.values())):
                # not all of them fit: not our model (the load will say so); leave ours as they are
                return Placement(m, {})
            return placement

        # providers describe their state when asked: give the manifest request time for that
        extra = {} if max_total is None else {"max_total": max_total}
        result = await fetch_state(self.host, self.key, wire, timeout=timeout, rpc_timeout=min(timeout, 30.0),
                                   place=place if into else None, **extra)
        claimed, label = max(p.epoch for p in providers), result.manifest.meta.get("epoch")
        if newest is not None and type(label) is int and label > claimed:  # (vet refuses a label of another type)
            claimed = max(claimed, await newest())
        vet(result, providers, at_least, strict, claimed)
        log.info("loaded the swarm's state (epoch %s, %.1f MB) from %d peers in %.2f s",
                 result.manifest.meta.get("epoch"), result.manifest.total_size / 1e6, len(result.contributors),
                 result.seconds)
        return result


def vet(result: FetchResult, providers: list[PeerReport], at_least: int, strict: bool,
        claimed: int | None = None) -> None:
    """StateTransferError unless the state fetched from ``providers`` is one to believe (see
    ``fetch``): labelled from ``at_least`` to ``claimed`` (default: what the providers report)."""
    epoch = result.manifest.meta.get("epoch")
    claimed = max(p.epoch for p in providers) if claimed is None else claimed
    who = ", ".join(p.peer.short() for p in providers[:4])
    if type(epoch) is not int or not at_least <= epoch <= claimed:
        raise UntrustedState(f"the state from {who} is labelled epoch {epoch!r:.20}, not one between {at_least} "
                             f"and the {claimed} they report")
    agreed, asked = result.votes
    if strict and asked >= 2 and 2 * agreed <= asked:
        raise UntrustedState(f"only {agreed} of the {asked} peers asked ({who}) serve that state: no majority")
