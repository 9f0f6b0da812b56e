"""The bounds a host keeps against hostile or broken peers (``Limits``), and a per-address log throttle.

Why a module of their own: every bound here is enforced somewhere else (the connection, the host,
the stream windows, the buffer pool) and documented once, here, with the measurement that set it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .stream import held_bound

__all__ = ["Limits", "LogThrottle"]


@dataclass
class Limits:
    """Per-connection and per-host bounds that keep a hostile peer from exhausting us."""

    handshake_timeout: float = 10.0
    frame_timeout: float = 30.0  # a started frame must complete within this (slow-loris guard)
    idle_timeout: float = 300.0  # connections with nothing in flight are closed after this
    max_concurrent_requests: int = 64  # per connection; more get a "busy" error
    #: Requests a peer may send on one connection per second, with bursts of ``request_burst``
    #: (a token bucket, ``dht.pacing``; 0 disables). Past it we stop reading that peer's socket
    #: until a token is due: its requests wait in the kernel's buffers and TCP pushes back on it,
    #: instead of every one costing us a decrypt, a decode and a handler on the event loop that
    #: training shares. A stream open spends a token too, a stream data frame under 64 KiB a
    #: quarter (else a flood of tiny frames goes unpaced); a big frame nothing,
    #: and senders join small writes (``dht.stream_transport``), so bulk data is not paced.
    #: Honest peers send tens to a few hundred per second (about 18 per epoch: matchmaking polls,
    #: progress reports, DHT lookups); the default leaves fast small-model swarms a wide margin.
    request_rate: float = 1000.0
    request_burst: int = 2000
    max_streams: int = 64  # per connection, both directions
    #: Each stream's receive window: what a sender may have in flight to us. None: 8 MiB, or 32 MiB
    #: where big frames are sealed on threads (``seal_threads``, by default where this process may
    #: use 4 or more CPUs): a sender that may run further ahead keeps them busy. On 2 cores a
    #: wider window only holds more memory (no faster round).
    stream_window: int | None = None
    #: Memory a peer can make us hold (the bound; ``peer_stream_memory`` computes it): every
    #: stream it opens may fill its window (``stream_window``) with data its handler has not read
    #: yet, in at most twice that memory (a big frame stays in the pooled buffer it arrived in, at
    #: most twice its frame; frames under 64 KiB are copied together, so 1-byte frames cost their
    #: byte, not a ~300-byte object each, and empty ones close the connection: see ``dht.stream``).
    #: So streams opened by the remote side are capped per connection: 16 x 2 x 8 MiB = 256 MiB
    #: per peer (1 GiB with 32 MiB windows), and, summed over all connections, to
    #: ``max_inbound_stream_memory`` of windows (None: 128 windows, 1 GiB with 8 MiB windows, 4 GiB
    #: on the many-core hosts that get 32 MiB ones, so that an averaging group may still have over
    #: 100 members; twice that in memory). Past either cap a new stream is reset with a reason
    #: ("too many streams", "busy") and the streams already open go on. A stream whose handler
    #: returned is reset unless the peer had ended it, and leaves the count once read to its end,
    #: so that a peer cannot keep streams queued past their use. An averaging round opens 1-2
    #: streams per peer pair. Besides streams: at most ``max_concurrent_requests`` RPC bodies of
    #: 1 MiB each, each decoding to a bounded size (``dht.wire.unpack``), held while its handler
    #: runs; a stream's header is at most 16 KiB.
    #: Shared by all peers, on top: the frame buffer pool (``buffer_pool_bytes``).
    max_inbound_streams: int = 16
    max_inbound_stream_memory: int | None = None
    #: A peer whose streams were refused for capacity this many times is disconnected: each
    #: refused stream may still bring a window of data in flight (decrypted, then dropped), so a
    #: peer that keeps opening past the caps costs us bandwidth and CPU without holding memory.
    max_refused_streams: int = 64
    max_connections: int = 1024
    #: inbound connections still in their handshake, from all addresses / from one IP address.
    #: Past either cap a new inbound connection is closed at once: a flood of sockets that never
    #: finish a handshake (held open until ``handshake_timeout``) cannot fill ``max_connections``
    #: and lock out real peers (benchmarks/flood.py). Per IP it stays well above what
    #: a local swarm of a few hundred nodes on 127.0.0.1 opens at once when they all join.
    max_handshakes: int = 256
    max_handshakes_per_ip: int = 64
    write_buffer_high: int = 4 << 20
    #: frame buffers (up to 4 MiB each, sized to the frames) a host keeps for reuse by big frames,
    #: received, decrypted or encrypted, shared by all its connections; 0 disables (a connection
    #: then keeps a receive buffer of its own). An 8-member all-reduce holds tens of 4 MiB frames
    #: at its peak (frames queued in 14 streams, both ways, and the ones being received), and
    #: more of int8's ~1 MiB ones. Each pool miss costs a zero-filled, page-faulting allocation.
    #: Buffers are only allocated when that many frames are in flight at once, so a DHT-only
    #: node never holds any.
    buffer_pool: int = 128
    #: ... and at most this many bytes of them in all: 32 whole frames (4 MiB and a header,
    #: rounded up to the pool's 64 KiB granule), or ~125 of int8's frames
    buffer_pool_bytes: int = 136 << 20
    #: threads that encrypt big outgoing frames off the event loop (``dht.sealer``); None: 2 where
    #: the process may use 4 or more CPUs, else 0 (inline: on 2 cores a thread only competes with
    #: the loop). ``benchmarks/allreduce_bench.py
    #: --seal-threads T --stream-window B`` measures both knobs (see ``stream_window``).
    seal_threads: int | None = None
    #: where there are such threads, big incoming stream frames are decrypted on them too, handed
    #: on in arrival order; a connection then holds at most ``dht.sealer.MAX_OPENING`` received
    #: frames beyond its streams' windows before it stops reading its socket (False: decrypted on
    #: the loop, to compare: ``allreduce_bench.py --decrypt-on-pool off``)
    decrypt_on_pool: bool = True

    def peer_stream_memory(self, window: int) -> int:
        """The most one peer's streams can make us hold (see ``max_inbound_streams``), with
        receive windows of ``window`` bytes (``Host.stream_window``)."""
        return self.max_inbound_streams * held_bound(window)


class LogThrottle:
    """Whether to log an event about a remote address now: at most once per ``interval`` seconds
    per address, counting the events held back. Sans-IO (the caller passes the time); at most
    ``max_addresses`` are remembered, so a flood from many addresses cannot grow it either."""

    def __init__(self, interval: float = 60.0, max_addresses: int = 4096):
        self.interval = interval
        self.max_addresses = max_addresses
        self._last: dict[str, tuple[float, int]] = {}  # address -> (when last logged, held back since)

    def allow(self, address: str, now: float) -> int | None:
        """None: stay quiet. Else log, mentioning the returned number of events held back."""
        last = self._last.get(address)
        if last is not None and now - last[0] < self.interval:
            self._last[address] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._last) >= self.max_addresses:
            self._last = {a: v for a, v in self._last.items() if now - v[0] < self.interval}
            if len(self._last) >= self.max_addresses:
                return None  # flooded from everywhere: one line per address already went out
        self._last[address] = (now, 0)
        return last[1] if last is not None else 0
