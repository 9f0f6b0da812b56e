"""A DHT node for synchronous code: the node runs on the process's background event loop.

Training scripts are ordinary blocking Python; ``DHTNode`` is asyncio. ``DHT`` owns a
:class:`~p2ptrain.loop.LoopThread` and a started ``DHTNode`` on it, so a script writes::

    dht = p2ptrain.DHT(initial_peers=["/ip4/1.2.3.4/tcp/4001/p2p/12D3Koo..."])
    opt = DecentralizedOptimizer(torch.optim.AdamW(...), dht=dht, run_id="my-run", ...)
    ...
    opt.close(); dht.close()

Several objects (optimizers, averagers) can share one ``DHT``; each schedules its coroutines on
``dht.loop`` and none of them may block it.
"""

from __future__ import annotations

import os
from collections.abc import Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from dht import DHTConfig, DHTNode, Identity, Multiaddr, MultiaddrError, SwarmKey, load_swarm_key

from .loop import LoopThread

T = TypeVar("T")

#: the bootstrap peers ``p2ptrain peer --script`` hands the script it runs (space or comma separated)
BOOTSTRAP_ENV = "P2PTRAIN_BOOTSTRAP"


def parse_multiaddrs(addrs: Iterable[str | Multiaddr], where: str = "") -> list[Multiaddr]:
    """``addrs`` as ``Multiaddr`` objects, text parsed here once: the edge where a library caller's
    strings become addresses. A bad one raises the one-line ``MultiaddrError`` naming it, after
    ``where`` (the option or variable it came from) when given."""
    out = []
    for a in addrs:
        try:
            out.append(a if isinstance(a, Multiaddr) else Multiaddr.parse(a))
        except MultiaddrError as e:
            raise MultiaddrError(f"{where}: {e}" if where else str(e)) from None
    return out


def env_bootstrap() -> list[Multiaddr]:
    """The peers in ``$P2PTRAIN_BOOTSTRAP``: the one place p2ptrain reads that variable. ``DHT()``
    without ``initial_peers`` joins them, so a script run by ``p2ptrain peer --script`` (which sets
    it) joins the peers given to the command; the CLI falls back to it without ``--bootstrap``."""
    return parse_multiaddrs(os.environ.get(BOOTSTRAP_ENV, "").replace(",", " ").split(), f"${BOOTSTRAP_ENV}")


class DHT:
    """A started :class:`dht.DHTNode` on a background loop this object owns.

    ``initial_peers``: multiaddrs (strings or ``Multiaddr``, parsed here) of peers already in the
    swarm; an empty list makes this the first peer; None (the default) joins :func:`env_bootstrap`'s.

    ``listen``: (host, port); by default every interface and a free port, announcing every
    routable interface address (``multiaddrs``), as ``p2ptrain peer`` does; ``("127.0.0.1", 0)``
    keeps the peer to this machine. ``listen=None`` runs a client-mode node (no inbound
    connections: it can average but serves nothing). ``announce_host``: the one host others dial
    instead (e.g. a NAT's public address). ``key_file``: keep the same PeerID across restarts.

    ``swarm_key`` (a :class:`dht.swarmkey.SwarmKey`, its 32 bytes, or the path of a swarm key file)
    joins a private swarm: only peers with the same key can connect. None (the default) reads the
    file named by ``$P2PTRAIN_SWARM_KEY_FILE`` when set, as ``p2ptrain peer --swarm-key-file`` hands
    it to the scripts it runs; ``swarm_key=False`` forces a public swarm.
    """

    def __init__(
        self,
        initial_peers: Sequence[str | Multiaddr] | None = None,
        *,
        listen: tuple[str, int] | None = ("0.0.0.0", 0),
        identity: Identity | None = None,
        key_file: str | Path | None = None,
        config: DHTConfig | None = None,
        announce_host: str | None = None,
        start_timeout: float = 30.0,
        swarm_key: SwarmKey | bytes | str | Path | bool | None = None,
        reachable: bool = True,
    ):
        peers = env_bootstrap() if initial_peers is None else parse_multiaddrs(initial_peers)
        if identity is None and key_file is not None:
            identity = Identity.load_or_create(key_file)
        if swarm_key is None:
            swarm_key = os.environ.get("P2PTRAIN_SWARM_KEY_FILE") or None
        key = None if swarm_key is False else load_swarm_key(swarm_key)  # type: ignore[arg-type]
        self.loop = LoopThread("p2ptrain-dht")
        self.node = DHTNode(identity, listen, config=config, announce_host=announce_host, swarm_key=key,
                            reachable=reachable)
        try:
            self.loop.run(self.node.start(peers), timeout=start_timeout)
        except BaseException:
            self._shutdown()
            raise
        self._closed = False

    @property
    def peer_id(self) -> Any:
        return self.node.peer_id

    @property
    def multiaddrs(self) -> list[Multiaddr]:
        """Full multiaddrs (with ``/p2p/<id>``) other peers can bootstrap from: one per routable
        interface address when listening on all interfaces, the default route's first."""
        return self.node.multiaddrs

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the DHT's loop and wait for it (for code outside the loop)."""
        return self.loop.run(coro, timeout)

    def _shutdown(self) -> None:
        try:
            self.loop.run(self.node.close(), timeout=10)
        except Exception:  # noqa: BLE001 - closing must not raise over the error that brought us here
            pass
        self.loop.close()

    def close(self) -> None:
        """Leave the swarm and stop the loop (idempotent)."""
        if not getattr(self, "_closed", True):
            self._closed = True
            self._shutdown()

    def __enter__(self) -> DHT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
