"""Transport over real loopback sockets: RPC, streams, limits, hostile peers, lifetimes.

Every test runs its hosts in one event loop, is bounded by ``asyncio.timeout`` and closes its hosts
through the ``make_host`` fixture, even when it fails.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import socket
import struct
import time

import pytest

from dht.connection import DEFAULT_PROLOGUE
from dht.errors import HandshakeError, PeerIdMismatch, PeerUnreachable, ProtocolError, RPCError, RPCTimeout
from dht.identity import Identity
from dht.limits import Limits
from dht.multiaddr import Multiaddr
from dht.noise import XXHandshake
from dht.stream import Stream, StreamReset
from dht.transport import Host
from dht.wire import HEADER_SIZE, LENGTH, Kind, pack, pack_header, parse_header, unpack

MiB = 1 << 20


# Nothing may reach the loop's exception handler (e.g. "Task exception was never retrieved").
pytestmark = pytest.mark.usefixtures("loop_errors")


async def _echo(args):
    return args


def addr(host: Host) -> tuple[str, int]:
    assert host.listen_port is not None
    return ("127.0.0.1", host.listen_port)


async def connect(a: Host, b: Host):
    return await a.connect(*addr(b), peer=b.peer_id)


async def assert_serves(b: Host, make_host) -> None:
    """``b`` still answers a normal RPC from a fresh, legitimate Host."""
    other = await make_host()
    assert await other.call(b.peer_id, addr(b), "echo", {"still": "alive"}) == {"still": "alive"}


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------ raw-socket helpers

async def wait_closed_by_peer(reader: asyncio.StreamReader, within: float) -> float:
    """Read until the host closes (EOF or reset); fail if that takes longer than ``within``."""
    start = time.monotonic()
    async with asyncio.timeout(within):
        while True:
            try:
                data = await reader.read(1 << 16)
            except (ConnectionResetError, BrokenPipeError):
                break
            if not data:
                break
    return time.monotonic() - start


class RawPeer:
    """A hand-driven legitimate peer: real Noise handshake, then frames we build ourselves."""

    def __init__(self, reader, writer, hs: XXHandshake):
        self.reader, self.writer, self.hs = reader, writer, hs
        self.send, self.recv = hs.send_cipher, hs.recv_cipher

    @classmethod
    async def connect(cls, host: Host, *, hold_message_3: bool = False) -> tuple[RawPeer, bytes]:
        """Handshake with ``host``; returns the peer and message 3 (already sent unless held)."""
        reader, writer = await asyncio.open_connection(*addr(host))
        hs = XXHandshake(
            Identity(), True, prologue=DEFAULT_PROLOGUE, expected_peer=host.peer_id, local_payload={"port": None}
        )
        m1 = hs.write_message()
        writer.write(struct.pack(">H", len(m1)) + m1)
        (n,) = struct.unpack(">H", await reader.readexactly(2))
        hs.read_message(await reader.readexactly(n))
        m3 = hs.write_message()
        m3 = struct.pack(">H", len(m3)) + m3
        if not hold_message_3:
            writer.write(m3)
        return cls(reader, writer, hs), m3

    def frame(self, kind: int, ident: int, body: bytes = b"") -> bytes:
        header = struct.pack(">BBHI", kind, 0, 0, ident)
        ct = self.send.encrypt(header, body)
        return LENGTH.pack(HEADER_SIZE + len(ct)) + header + ct

    async def read_frame(self) -> tuple[Kind, int, bytes]:
        (n,) = LENGTH.unpack(await self.reader.readexactly(4))
        data = await self.reader.readexactly(n)
        header = data[:HEADER_SIZE]
        kind, _flags, ident = parse_header(header)
        return kind, ident, self.recv.decrypt(header, data[HEADER_SIZE:])

    async def rpc(self, ident: int, method: str, args) -> object:
        self.writer.write(self.frame(Kind.REQUEST, ident, pack([method, args])))
        kind, got_ident, body = await self.read_frame()
        assert (kind, got_ident) == (Kind.RESPONSE, ident)
        return unpack(body)

    def close(self) -> None:
        self.writer.close()


# ------------------------------------------------------------------ RPC

async def test_rpc_round_trip(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        seen = []

        async def handler(conn, args):
            seen.append(conn.remote_peer)
            return {"sum": sum(args["xs"]), "blob": args["blob"]}

        b.on_request("add", handler)
        conn = await connect(a, b)
        assert conn.remote_peer == b.peer_id
        result = await conn.call("add", {"xs": [1, 2, 3], "blob": b"\x00\xff"})
        assert result == {"sum": 6, "blob": b"\x00\xff"}
        assert seen == [a.peer_id]
        # the listener learned the dialer's identity and can call back on the same connection
        back = b.connection(a.peer_id)
        assert back is not None and back.remote_peer == a.peer_id
        assert await back.call("echo", [1, "x"]) == [1, "x"]
        # Host.call reuses the open connection
        assert await a.call(b.peer_id, None, "echo", 7) == 7
        assert len(a.connections) == 1


def _ready_counter(host: Host, n: int) -> tuple[asyncio.Event, list]:
    """An event set once ``host`` has seen ``n`` more connections finish their handshake, and them."""
    done, seen = asyncio.Event(), []

    def on_ready(conn) -> None:
        seen.append(conn)
        if len(seen) >= n:
            done.set()

    host.on_connect.append(on_ready)
    return done, seen


def _socket_of(conn) -> tuple:
    return conn._transport.get_extra_info("sockname"), conn._transport.get_extra_info("peername")


async def test_peers_that_dial_each_other_at_once_send_on_one_connection(make_host):
    """Both ends pick the connection the smaller peer id dialed (before, each sent on its own)."""
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        (ready_a, seen_a), (ready_b, seen_b) = _ready_counter(a, 2), _ready_counter(b, 2)
        await asyncio.gather(a.connect(*addr(b), b.peer_id), b.connect(*addr(a), a.peer_id))
        await ready_a.wait()
        await ready_b.wait()
        assert not any(c.is_closed for c in seen_a + seen_b)  # both stay open (and served)
        ca, cb = a.connection(b.peer_id), b.connection(a.peer_id)
        local_a, remote_a = _socket_of(ca)
        local_b, remote_b = _socket_of(cb)
        assert (local_a, remote_a) == (remote_b, local_b)  # the same socket, seen from both ends
        dialed_by_a = ca.initiator
        assert dialed_by_a == (a.peer_id < b.peer_id)
        assert await a.call(b.peer_id, None, "echo", 1) == 1
        assert await b.call(a.peer_id, None, "echo", 2) == 2


async def test_a_redialed_peer_is_reached_on_the_newer_connection(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        ready_b, _ = _ready_counter(b, 2)
        first = await a.connect(*addr(b), b.peer_id)
        second = await a._dial(*addr(b), b.peer_id, 5.0)  # what a redial makes, the first still open
        await ready_b.wait()
        assert a.connection(b.peer_id) is second
        assert _socket_of(b.connection(a.peer_id))[1] == _socket_of(second)[0]  # b answers on it too
        assert not first.is_closed


async def test_connect_addr_with_listen_addrs(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        (ma,) = b.listen_addrs
        assert ma == Multiaddr("ip4", "127.0.0.1", b.listen_port, b.peer_id)
        conn = await a.connect_addr(Multiaddr.parse(str(ma)))
        assert conn.remote_peer == b.peer_id
        assert await conn.call("echo", "hi") == "hi"


async def test_remote_exception_becomes_rpc_error_and_connection_survives(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()

        async def bad_value(conn, args):
            raise ValueError(f"bad input {args}")

        async def crash(conn, args):
            raise RuntimeError("secret internal detail")

        b.on_request("bad_value", bad_value)
        b.on_request("crash", crash)
        conn = await connect(a, b)
        with pytest.raises(RPCError, match="bad input 42"):
            await conn.call("bad_value", 42)
        with pytest.raises(RPCError, match="crash: internal error") as info:
            await conn.call("crash")
        assert "secret internal detail" not in str(info.value)
        assert not conn.is_closed
        assert await conn.call("echo", "after") == "after"
        assert a.connection(b.peer_id) is conn


async def test_unknown_method(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        conn = await connect(a, b)
        with pytest.raises(RPCError, match="unknown method 'nope'"):
            await conn.call("nope", None)
        assert await conn.call("echo", 1) == 1


async def test_call_timeout_cancels_remote_handler(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def hang(conn, args):
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        b.on_request("hang", hang)
        conn = await connect(a, b)
        t0 = time.monotonic()
        with pytest.raises(RPCTimeout, match="hang"):
            await conn.call("hang", None, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 2
        assert started.is_set()
        await asyncio.wait_for(cancelled.wait(), 2)
        assert await conn.call("echo", "ok") == "ok"
        server_conn = b.connection(a.peer_id)
        assert server_conn._serving == {}


async def test_caller_cancellation_cancels_remote_handler(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def hang(conn, args):
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        b.on_request("hang", hang)
        conn = await connect(a, b)
        task = asyncio.create_task(conn.call("hang", None, timeout=30))
        await asyncio.wait_for(started.wait(), 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(cancelled.wait(), 2)
        assert conn._calls == {}
        assert await conn.call("echo", "ok") == "ok"


async def test_many_concurrent_calls_share_one_connection(make_host):
    async with asyncio.timeout(15):
        a, b = await make_host(), await make_host()
        n = 50
        arrived = 0
        all_in = asyncio.Event()

        async def gather_then_answer(conn, args):
            nonlocal arrived
            arrived += 1
            if arrived == n:
                all_in.set()
            await all_in.wait()  # every call is in flight at once
            return args * 2

        b.on_request("double", gather_then_answer)
        # no connection yet: concurrent Host.call must coalesce into a single dial
        results = await asyncio.gather(*(a.call(b.peer_id, addr(b), "double", i) for i in range(n)))
        assert results == [2 * i for i in range(n)]
        assert len(a.connections) == 1
        assert len(b.connections) == 1


async def test_busy_beyond_max_concurrent_requests(make_host):
    async with asyncio.timeout(10):
        a = await make_host()
        b = await make_host(Limits(max_concurrent_requests=4))
        release = asyncio.Event()
        inside = 0
        four_in = asyncio.Event()

        async def block(conn, args):
            nonlocal inside
            inside += 1
            if inside == 4:
                four_in.set()
            await release.wait()
            return args

        b.on_request("block", block)
        conn = await connect(a, b)
        first = [asyncio.create_task(conn.call("block", i)) for i in range(4)]
        await asyncio.wait_for(four_in.wait(), 2)
        with pytest.raises(RPCError, match="busy"):
            await conn.call("block", 5)
        release.set()
        assert await asyncio.gather(*first) == [0, 1, 2, 3]
        # capacity is back once the handlers finished
        assert await conn.call("block", 6) == 6


async def test_request_flood_is_paced_per_connection(make_host):
    """Past ``request_rate`` a peer's requests get "busy" (those already read) and its socket is
    left unread until a token is due: it is served at the rate, while another peer's calls to the
    same host stay fast."""
    async with asyncio.timeout(20):
        victim = await make_host(Limits(request_rate=50, request_burst=10))
        flooder, other = await make_host(), await make_host()
        conn, calm = await connect(flooder, victim), await connect(other, victim)
        results = await asyncio.gather(*(conn.call("echo", i, timeout=10) for i in range(60)), return_exceptions=True)
        served = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, RPCError)]
        # the burst (plus what refills while it is served), then "busy" for the rest of that read
        assert 10 <= len(served) <= 13 and served == list(range(len(served))), results
        assert len(refused) == 60 - len(served)
        assert all("busy" in str(e) for e in refused)
        t0 = time.monotonic()
        assert await calm.call("echo", "hi") == "hi"  # another peer is not held up
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        assert await conn.call("echo", "again", timeout=10) == "again"  # read once a token is due
        assert time.monotonic() - t0 >= 0.01
        for _ in range(20):  # at the rate: served, none refused
            assert await conn.call("echo", 1, timeout=10) == 1
        assert time.monotonic() - t0 >= 0.3  # 20 calls at 50/s
        flood_side, calm_side = victim.connection(flooder.peer_id), victim.connection(other.peer_id)
        assert flood_side is not None and flood_side.throttled_s > 0
        assert calm_side is not None and calm_side.throttled_s == 0


# ------------------------------------------------------------------ dialing and identity

async def test_impersonation_is_refused(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        c = Identity()
        with pytest.raises(PeerIdMismatch) as info:  # its own class: a retry cannot fix it
            await a.connect(*addr(b), peer=c.peer_id)
        assert str(c.peer_id) in str(info.value) and str(b.peer_id) in str(info.value)
        assert a.connections == []
        conn = await a.connect(*addr(b), peer=b.peer_id)
        assert conn.remote_peer == b.peer_id
        assert await conn.call("echo", "real") == "real"


async def test_dial_without_expected_peer_learns_it(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        conn = await a.connect(*addr(b))
        assert conn.remote_peer == b.peer_id
        assert a.connection(b.peer_id) is conn


async def test_different_prologue_fails_handshake(make_host):
    async with asyncio.timeout(10):
        a = await make_host(prologue=b"other-swarm")
        b = await make_host()
        with pytest.raises(HandshakeError) as info:
            await a.connect(*addr(b), peer=b.peer_id)
        assert not isinstance(info.value, PeerIdMismatch)
        await assert_serves(b, make_host)


async def test_connect_to_closed_port_is_unreachable_quickly(make_host):
    async with asyncio.timeout(10):
        a = await make_host()
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match="cannot reach"):
            await a.connect("127.0.0.1", closed_port(), peer=Identity().peer_id, timeout=5)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(PeerUnreachable):
            await a.call(Identity().peer_id, ("127.0.0.1", closed_port()), "echo", 1)


async def test_refuses_to_dial_itself(make_host):
    async with asyncio.timeout(5):
        a = await make_host()
        with pytest.raises(PeerUnreachable, match="ourselves"):
            await a.connect(*addr(a), peer=a.peer_id)


async def test_client_mode(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        client = await make_host(listen=None)
        assert client.client_mode
        assert client.listen_addrs == []
        assert client.listen_port is None
        assert await client.call(b.peer_id, addr(b), "echo", "from client") == "from client"
        # the listener can use the connection the client made
        back = b.connection(client.peer_id)
        assert back is not None
        assert back.remote_listen_port is None
        assert await back.call("echo", "to client") == "to client"


async def test_remote_listen_port_is_learned(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        await connect(a, b)
        assert b.connection(a.peer_id).remote_listen_port == a.listen_port
        assert a.connection(b.peer_id).remote_listen_port == b.listen_port


# ------------------------------------------------------------------ streams

async def test_64_mib_stream_with_small_window(make_host):
    async with asyncio.timeout(25):
        limits = Limits(stream_window=256 * 1024)
        a, b = await make_host(limits), await make_host(limits)
        total = 64 * MiB

        async def sink(stream: Stream):
            digest = hashlib.sha256()
            count = 0
            async for chunk in stream:
                assert len(chunk) <= 256 * 1024
                digest.update(chunk)
                count += len(chunk)
            await stream.write(pack([count, digest.digest()]))

        b.on_stream("sink", sink)
        conn = await connect(a, b)
        stream = await conn.open_stream("sink", {"size": total})
        block = os.urandom(4 * MiB)
        sent = hashlib.sha256()
        for i in range(total // len(block)):
            piece = bytes([i]) + block[1:]
            sent.update(piece)
            await stream.write(piece, timeout=5)
        stream.write_eof()
        reply = await stream.read_all(1024, timeout=10)
        count, digest = unpack(reply)
        assert count == total
        assert digest == sent.digest()
        assert stream.bytes_sent == total
        assert stream.closed


async def test_stream_header_and_peer(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        got = asyncio.get_running_loop().create_future()

        async def handler(stream: Stream):
            got.set_result((stream.protocol, stream.header, stream.peer_id))

        b.on_stream("hdr", handler)
        conn = await connect(a, b)
        stream = await conn.open_stream("hdr", {"k": [1, 2]})
        assert await got == ("hdr", {"k": [1, 2]}, a.peer_id)
        assert await stream.read(timeout=5) is None  # handler returned: EOF


async def test_a_big_stream_frame_is_read_from_the_buffer_it_arrived_in(make_host):
    """Big stream frames are decrypted in place: each chunk a reader holds is a read-only view of
    the pooled buffer its frame was received into, so the pool lends one buffer per frame held,
    not a receive buffer and a plaintext buffer."""
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        held: list[memoryview] = []
        done = asyncio.get_running_loop().create_future()

        async def hold(stream: Stream):
            while (chunk := await stream.read(timeout=5)) is not None:
                held.append(chunk)
            done.set_result(None)

        b.on_stream("hold", hold)
        conn = await connect(a, b)
        stream = await conn.open_stream("hold")
        payloads = [os.urandom(conn.max_data_body) for _ in range(3)]
        for p in payloads:
            await stream.write(p, timeout=5)
        stream.write_eof()
        await done
        assert [bytes(c) for c in held] == payloads and all(c.readonly for c in held)
        pool = b.pool
        in_use = [i for i in range(len(pool._bufs)) if pool._refs(i) > pool._idle_refs]
        assert len(in_use) == 3 and len(pool._bufs) == 3  # no second buffer per frame
        assert {c.obj is pool._bufs[i] for c, i in zip(held, in_use)} == {True}
        held.clear()
        assert all(pool._refs(i) <= pool._idle_refs for i in range(len(pool._bufs)))  # all reusable


async def test_slow_consumer_bounds_what_the_writer_sends(make_host):
    async with asyncio.timeout(20):
        window = 1 * MiB
        limits = Limits(stream_window=window)
        a, b = await make_host(limits), await make_host(limits)
        go = asyncio.Event()
        server_stream: list[Stream] = []
        result = asyncio.get_running_loop().create_future()

        async def lazy(stream: Stream):
            server_stream.append(stream)
            await go.wait()  # reads nothing for a while
            digest = hashlib.sha256()
            async for chunk in stream:
                digest.update(chunk)
            result.set_result(digest.digest())

        b.on_stream("lazy", lazy)
        conn = await connect(a, b)
        stream = await conn.open_stream("lazy")
        data = os.urandom(32 * MiB)
        with pytest.raises(RPCTimeout, match="flow-control credit"):
            await stream.write(data, timeout=0.5)
        # exactly one window went out, and the receiver holds no more than that
        assert stream.bytes_sent == window
        assert server_stream and server_stream[0]._buffered <= window
        assert server_stream[0].bytes_received <= window
        go.set()
        await stream.write(memoryview(data)[stream.bytes_sent :], timeout=5)
        stream.write_eof()
        assert await asyncio.wait_for(result, 10) == hashlib.sha256(data).digest()


async def test_readinto_fills_a_memoryview(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        payload = os.urandom(3 * MiB + 123)

        async def source(stream: Stream):
            size = stream.header["size"]
            await stream.write(payload[:size])

        b.on_stream("source", source)
        conn = await connect(a, b)

        buf = bytearray(len(payload))
        stream = await conn.open_stream("source", {"size": len(payload)})
        n = await stream.readinto(memoryview(buf), timeout=5)
        assert n == len(payload)
        assert buf == payload
        assert await stream.read(timeout=5) is None

        # a short stream fills only part of the buffer
        buf = bytearray(1000)
        stream = await conn.open_stream("source", {"size": 600})
        assert await stream.readinto(memoryview(buf), timeout=5) == 600
        assert buf[:600] == payload[:600] and buf[600:] == bytes(400)

        # more data than the buffer holds is refused and resets the stream
        stream = await conn.open_stream("source", {"size": 5000})
        with pytest.raises(ProtocolError, match="more data"):
            await stream.readinto(memoryview(bytearray(4000)), timeout=5)
        with pytest.raises(StreamReset):
            await stream.read(timeout=5)
        assert await conn.call("echo", "fine") == "fine"


async def test_reset_by_handler_reaches_opener(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()

        async def refuse(stream: Stream):
            await stream.read(timeout=5)
            stream.reset("not today")

        b.on_stream("refuse", refuse)
        conn = await connect(a, b)
        stream = await conn.open_stream("refuse")
        await stream.write(b"hello")
        with pytest.raises(StreamReset, match="not today"):
            await stream.read(timeout=5)
        with pytest.raises(StreamReset):
            await stream.write(b"more")
        assert await conn.call("echo", 1) == 1


async def test_reset_by_opener_reaches_handler(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        outcome = asyncio.get_running_loop().create_future()

        async def reader(stream: Stream):
            try:
                while await stream.read(timeout=5) is not None:
                    pass
                outcome.set_result("eof")
            except StreamReset as e:
                outcome.set_result(f"reset: {e}")
                raise

        b.on_stream("reader", reader)
        conn = await connect(a, b)
        stream = await conn.open_stream("reader")
        await stream.write(b"x" * 1000)
        stream.reset("changed my mind")
        result = await asyncio.wait_for(outcome, 5)
        assert result.startswith("reset:") and "changed my mind" in result
        assert await conn.call("echo", 2) == 2


async def test_handler_error_resets_stream(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()

        async def broken(stream: Stream):
            raise RuntimeError("boom")

        b.on_stream("broken", broken)
        conn = await connect(a, b)
        stream = await conn.open_stream("broken")
        with pytest.raises(StreamReset, match="internal error"):
            await stream.read(timeout=5)


async def test_unknown_protocol_resets_stream(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        conn = await connect(a, b)
        stream = await conn.open_stream("no-such-protocol")
        with pytest.raises(StreamReset, match="unknown protocol 'no-such-protocol'"):
            await stream.read(timeout=5)
        assert not conn.is_closed
        assert await conn.call("echo", 3) == 3


async def test_peer_cannot_hold_more_than_its_share_of_stream_memory(make_host):
    """Streams a peer opens are capped per connection, and their windows summed over all peers
    are capped per host: past either, new streams are reset with the reason, open ones go on, and
    the budget comes back as streams end (including with their connection)."""
    async with asyncio.timeout(20):
        window = 1 * MiB
        victim = await make_host(Limits(stream_window=window, max_inbound_streams=3,
                                        max_inbound_stream_memory=5 * window))
        release = asyncio.Event()

        async def hold(stream: Stream):  # a handler that reads nothing until told
            await release.wait()
            await stream.read_all(64 * MiB)

        victim.on_stream("hold", hold)
        first, second = await make_host(), await make_host()
        c1, c2 = await connect(first, victim), await connect(second, victim)
        mine = [await c1.open_stream("hold") for _ in range(4)]
        with pytest.raises(StreamReset, match="too many streams"):
            await mine[3].read(timeout=5)
        assert await c1.call("echo", 1) == 1  # the connection itself is fine
        for st in mine[:3]:
            await st.write(os.urandom(window), timeout=5)  # each fills its window: 3 MiB held for this peer
        theirs = [await c2.open_stream("hold") for _ in range(3)]
        with pytest.raises(StreamReset, match="busy"):
            await theirs[2].read(timeout=5)  # 3 + 2 windows open on the victim: the host cap
        assert victim.inbound_stream_memory == 5 * window
        release.set()
        for st in mine[:3] + theirs[:2]:
            st.write_eof()
            assert await st.read(timeout=5) is None
        assert victim.inbound_stream_memory == 0  # ended streams gave their windows back
        held = await c1.open_stream("hold")
        assert held and await c1.call("echo", 2) == 2  # (frames are ordered: the open was served)
        assert victim.inbound_stream_memory == window
        gone = asyncio.Event()
        victim.on_disconnect(lambda _peer: gone.set())
        await first.close()
        await gone.wait()
        assert victim.inbound_stream_memory == 0  # and so did the streams of a dead connection
        again = [await c2.open_stream("hold") for _ in range(3)]
        for st in again:
            st.write_eof()
            assert await st.read(timeout=5) is None


async def test_peer_that_keeps_opening_refused_streams_is_disconnected(make_host):
    async with asyncio.timeout(20):
        victim = await make_host(Limits(max_inbound_streams=1, max_refused_streams=3))
        hold = asyncio.Event()

        async def wait(stream: Stream):
            await hold.wait()

        victim.on_stream("hold", wait)
        peer = await make_host()
        conn = await connect(peer, victim)
        await conn.open_stream("hold")
        for _ in range(3):  # refused, but tolerated
            st = await conn.open_stream("hold")
            with pytest.raises(StreamReset, match="too many streams"):
                await st.read(timeout=5)
        assert await conn.call("echo", 1) == 1
        st = await conn.open_stream("hold")  # one more: the victim hangs up
        with pytest.raises(StreamReset):
            await st.read(timeout=5)
        with pytest.raises(PeerUnreachable):
            await conn.call("echo", 2, timeout=5)
        hold.set()


async def test_streams_die_with_their_connection(make_host):
    async with asyncio.timeout(10):
        a, b = await make_host(), await make_host()
        opened = asyncio.Event()

        async def hold(stream: Stream):
            opened.set()
            await asyncio.Event().wait()

        b.on_stream("hold", hold)
        conn = await connect(a, b)
        stream = await conn.open_stream("hold")
        await asyncio.wait_for(opened.wait(), 5)
        pending = asyncio.create_task(conn.call("echo", 1))
        await b.close()
        with pytest.raises(StreamReset):
            await stream.read(timeout=5)
        try:
            await pending  # may have been answered before b closed
        except PeerUnreachable:
            pass
        with pytest.raises(PeerUnreachable):
            await conn.call("echo", 2)


async def test_disconnect_listener_fires_when_a_peer_is_gone(make_host):
    async with asyncio.timeout(10):
        a, b, c = await make_host(), await make_host(), await make_host()
        lost: list = []
        gone = asyncio.Event()

        def listener(peer):
            lost.append(peer)
            gone.set()

        unsubscribe = a.on_disconnect(listener)
        await connect(a, b)
        await connect(c, a)  # inbound connections count too
        await b.close()
        await gone.wait()
        assert lost == [b.peer_id]
        unsubscribe()
        await c.close()
        await wait_until(lambda: a.connection(c.peer_id) is None, within=5)
        assert lost == [b.peer_id]  # unsubscribed: c's loss was not reported


# ------------------------------------------------------------------ hostile input

async def test_garbage_instead_of_handshake(make_host):
    async with asyncio.timeout(15):
        b = await make_host(Limits(handshake_timeout=1.0))
        for garbage in (
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # length 0x4745: too large, closed at once
            b"\x00\x05hello",  # a complete first message of the wrong size
            b"\x00\x40" + os.urandom(20),  # an incomplete message: cut off by the handshake timeout
            os.urandom(3000),
        ):
            reader, writer = await asyncio.open_connection(*addr(b))
            try:
                writer.write(garbage)
                await wait_closed_by_peer(reader, within=3.0)
            finally:
                writer.close()
        await assert_serves(b, make_host)


async def test_bad_message_3_is_rejected(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, m3 = await RawPeer.connect(b, hold_message_3=True)
        try:
            bad = bytearray(m3)
            bad[-1] ^= 1
            peer.writer.write(bytes(bad))
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_oversized_handshake_length_is_closed_at_once(make_host):
    async with asyncio.timeout(10):
        b = await make_host(Limits(handshake_timeout=5.0))
        reader, writer = await asyncio.open_connection(*addr(b))
        try:
            writer.write(b"\xff\xff" + b"\x00" * 100)
            elapsed = await wait_closed_by_peer(reader, within=2.0)
        finally:
            writer.close()
        assert elapsed < 1.0  # not merely the handshake timeout
        await assert_serves(b, make_host)


@pytest.mark.parametrize("send", [b"", b"\x00", b"\x00\x20" + b"\x01" * 10])
async def test_slow_loris_handshake(make_host, send):
    async with asyncio.timeout(10):
        b = await make_host(Limits(handshake_timeout=0.5))
        reader, writer = await asyncio.open_connection(*addr(b))
        try:
            writer.write(send)
            elapsed = await wait_closed_by_peer(reader, within=2.0)
        finally:
            writer.close()
        assert elapsed >= 0.3
        await assert_serves(b, make_host)


async def test_failed_handshakes_leave_no_unretrieved_errors(make_host, loop_errors):
    # a listener-side handshake failure has no awaiter: it must not log "exception was never retrieved"
    async with asyncio.timeout(10):
        b = await make_host(Limits(handshake_timeout=0.3))
        for garbage in (b"", b"\x00\x05hello"):  # times out / fails outright
            reader, writer = await asyncio.open_connection(*addr(b))
            try:
                writer.write(garbage)
                await wait_closed_by_peer(reader, within=2.0)
            finally:
                writer.close()
        await b.close()
    gc.collect()
    assert loop_errors == []


async def test_raw_peer_is_legitimate(make_host):
    # sanity check of the hand-driven peer the hostile tests below build on
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            assert await peer.rpc(1, "echo", {"raw": True}) == {"raw": True}
            assert await peer.rpc(3, "echo", [1]) == [1]
        finally:
            peer.close()


async def test_huge_declared_frame_length_closes_connection(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            assert await peer.rpc(1, "echo", "ok") == "ok"
            peer.writer.write(LENGTH.pack(2**31))
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_huge_declared_frame_length_right_after_handshake(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, m3 = await RawPeer.connect(b, hold_message_3=True)
        try:
            peer.writer.write(m3 + LENGTH.pack(2**31))  # in the same packet as message 3
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_partial_frame_stall_is_cut_off(make_host):
    async with asyncio.timeout(10):
        b = await make_host(Limits(frame_timeout=0.5))
        peer, _ = await RawPeer.connect(b)
        try:
            assert await peer.rpc(1, "echo", "ok") == "ok"
            frame = peer.frame(Kind.REQUEST, 3, pack(["echo", "x" * 100]))
            peer.writer.write(frame[: len(frame) // 2])
            elapsed = await wait_closed_by_peer(peer.reader, within=2.5)
        finally:
            peer.close()
        assert elapsed >= 0.4
        await assert_serves(b, make_host)


async def test_partial_frame_in_same_packet_as_message_3_is_cut_off(make_host):
    async with asyncio.timeout(10):
        b = await make_host(Limits(frame_timeout=0.5))
        peer, m3 = await RawPeer.connect(b, hold_message_3=True)
        try:
            frame = peer.frame(Kind.REQUEST, 1, pack(["echo", "x" * 100]))
            peer.writer.write(m3 + frame[:10])
            await wait_closed_by_peer(peer.reader, within=2.5)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_frames_in_same_packet_as_message_3_are_served(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, m3 = await RawPeer.connect(b, hold_message_3=True)
        try:
            peer.writer.write(
                m3 + peer.frame(Kind.REQUEST, 1, pack(["echo", "a"])) + peer.frame(Kind.REQUEST, 3, pack(["echo", "b"]))
            )
            answers = {}
            for _ in range(2):
                kind, ident, body = await peer.read_frame()
                assert kind == Kind.RESPONSE
                answers[ident] = unpack(body)
            assert answers == {1: "a", 3: "b"}
        finally:
            peer.close()


@pytest.mark.parametrize("where", ["tag", "ciphertext", "header"])
async def test_corrupted_frame_closes_connection(make_host, where):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            assert await peer.rpc(1, "echo", "ok") == "ok"
            frame = bytearray(peer.frame(Kind.REQUEST, 3, pack(["echo", "payload"])))
            index = {"tag": -1, "ciphertext": 4 + HEADER_SIZE + 1, "header": 4 + 7}[where]
            frame[index] ^= 0x01
            peer.writer.write(bytes(frame))
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


@pytest.mark.parametrize("kind", [0, 11, 200])
async def test_valid_frame_of_unknown_kind_closes_connection(make_host, kind):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            assert await peer.rpc(1, "echo", "ok") == "ok"
            peer.writer.write(peer.frame(kind, 3, b"well-encrypted body"))
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


@pytest.mark.parametrize(
    "body",
    [b"\xc1", pack("not a list"), pack([1, 2]), pack(["echo"]), pack(["echo", 1, 2])],
)
async def test_malformed_request_closes_connection(make_host, body):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            peer.writer.write(peer.frame(Kind.REQUEST, 1, body))
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_stream_overrunning_window_closes_connection(make_host):
    async with asyncio.timeout(10):
        b = await make_host(Limits(stream_window=64 * 1024))
        opened = asyncio.Event()

        async def idle(stream: Stream):
            opened.set()
            await asyncio.Event().wait()

        b.on_stream("idle", idle)
        peer, _ = await RawPeer.connect(b)
        try:
            peer.writer.write(peer.frame(Kind.STREAM_OPEN, 1, pack(["idle", None])))
            await asyncio.wait_for(opened.wait(), 2)
            peer.writer.write(peer.frame(Kind.STREAM_DATA, 1, b"x" * (64 * 1024)))
            peer.writer.write(peer.frame(Kind.STREAM_DATA, 1, b"y"))  # one byte beyond the credit
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_frame_shorter_than_tag_closes_connection(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            assert await peer.rpc(1, "echo", "ok") == "ok"
            peer.writer.write(LENGTH.pack(HEADER_SIZE + 3) + pack_header(Kind.REQUEST, 3) + b"abc")
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_late_frames_for_unknown_ids_are_ignored(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            peer.writer.write(peer.frame(Kind.STREAM_DATA, 99, b"late"))
            peer.writer.write(peer.frame(Kind.STREAM_RESET, 99, pack("gone")))
            peer.writer.write(peer.frame(Kind.CANCEL, 97))
            peer.writer.write(peer.frame(Kind.RESPONSE, 95, pack("unsolicited")))
            assert await peer.rpc(1, "echo", "still here") == "still here"
        finally:
            peer.close()


async def test_goaway_closes_connection(make_host):
    async with asyncio.timeout(10):
        b = await make_host()
        peer, _ = await RawPeer.connect(b)
        try:
            assert await peer.rpc(1, "echo", "ok") == "ok"
            peer.writer.write(peer.frame(Kind.GOAWAY, 0, pack("bye")))
            await wait_closed_by_peer(peer.reader, within=2.0)
        finally:
            peer.close()
        await assert_serves(b, make_host)


async def test_max_connections(make_host):
    async with asyncio.timeout(10):
        b = await make_host(Limits(max_connections=1))
        a = await make_host()
        conn = await connect(a, b)
        reader, writer = await asyncio.open_connection(*addr(b))
        try:
            await wait_closed_by_peer(reader, within=1.0)
        finally:
            writer.close()
        assert await conn.call("echo", "first stays") == "first stays"


async def wait_until(predicate, within: float) -> None:
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_idle_connection_is_closed_and_redialed(make_host):
    async with asyncio.timeout(10):
        limits = Limits(idle_timeout=0.3, frame_timeout=2.0)
        a, b = await make_host(limits), await make_host()
        conn = await connect(a, b)
        assert await conn.call("echo", 1) == 1
        await wait_until(lambda: conn.is_closed, within=2.0)
        assert conn.close_reason == "idle"
        assert a.connection(b.peer_id) is None
        # the next call dials again transparently
        assert await a.call(b.peer_id, addr(b), "echo", 2) == 2


# ------------------------------------------------------------------ lifetimes

async def test_close_leaves_no_pending_tasks():
    async with asyncio.timeout(10):
        before = asyncio.all_tasks()
        a = Host(Identity())
        b = Host(Identity())
        client = Host(Identity(), listen=None)
        try:
            for h in (a, b, client):
                await h.start()
            started = asyncio.Event()

            async def hang(conn, args):
                started.set()
                await asyncio.Event().wait()

            async def hold(stream: Stream):
                await asyncio.Event().wait()

            b.on_request("hang", hang)
            b.on_request("echo", lambda _c, x: _echo(x))
            b.on_stream("hold", hold)
            conn = await connect(a, b)
            assert await client.call(b.peer_id, addr(b), "echo", 1) == 1
            pending_call = asyncio.create_task(conn.call("hang", None, timeout=30))
            await asyncio.wait_for(started.wait(), 2)
            stream = await conn.open_stream("hold")
            await stream.write(b"data")
            # a half-open raw connection still in its handshake
            _r, raw_writer = await asyncio.open_connection(*addr(b))
        finally:
            await a.close()
            await b.close()
            await client.close()
        with pytest.raises(PeerUnreachable):
            await pending_call
        leftover = {t for t in asyncio.all_tasks() - before if not t.done()}
        assert leftover == set(), leftover
        raw_writer.close()
        assert a.connections == [] and b.connections == []
        with pytest.raises(PeerUnreachable, match="closed"):
            await a.connect(*addr(b))


async def test_hosts_with_different_stream_windows_interoperate(make_host):
    # the window is a receiver's setting: a sender must respect the remote's, not its own
    async with asyncio.timeout(15):
        big = await make_host(Limits(stream_window=8 * MiB))
        small = await make_host(Limits(stream_window=128 * 1024))
        data = os.urandom(4 * MiB)

        async def sink(stream: Stream):
            received = await stream.read_all(len(data), timeout=5)
            await stream.write(hashlib.sha256(received).digest())

        async def source(stream: Stream):
            await stream.write(data, timeout=5)

        for h in (big, small):
            h.on_stream("sink", sink)
            h.on_stream("source", source)
        for a, b in ((big, small), (small, big)):
            conn = await connect(a, b)
            up = await conn.open_stream("sink")
            await up.write(data, timeout=5)
            up.write_eof()
            assert bytes(await up.read_all(64, timeout=5)) == hashlib.sha256(data).digest()
            down = await conn.open_stream("source")
            assert await down.read_all(len(data), timeout=5) == data
            assert not conn.is_closed


async def test_writer_blocked_on_a_full_socket_wakes_when_the_connection_dies(make_host):
    """A peer that stops reading fills our socket buffers; when it then dies, a writer waiting for
    the socket to drain must fail at once, not after its whole timeout."""
    async with asyncio.timeout(20):
        a, b = await make_host(), await make_host()
        started = asyncio.Event()

        async def never_reads(stream):
            started.set()
            await asyncio.Event().wait()

        b.on_stream("stuck", never_reads)
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        stream = await conn.open_stream("stuck")
        await started.wait()
        # A hung peer: its process stops reading the socket altogether. (Only ignoring the stream
        # is not that: b's connection would go on reading, see the stream overrun its window -- our
        # credit is faked below -- and close the connection itself before the test saw a full socket.)
        for c in list(b._all):
            c._transport.pause_reading()
        stream._send_credit = 1 << 40  # held by the socket, not by flow-control credit
        writer = asyncio.ensure_future(stream.write(bytes(256 << 20), timeout=60))
        while conn._write_ok.is_set():  # until the socket buffers fill and asyncio pauses us
            assert not writer.done(), writer.exception()
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        for c in list(b._all):
            c.close("crash", abort=True)
        with pytest.raises(PeerUnreachable):
            await writer
        assert time.monotonic() - t0 < 2.0


async def test_close_waits_for_the_tasks_serving_its_connections(make_host):
    """Host.close returns once every request handler its connections run has ended, cleanup included."""
    a, b = await make_host(), await make_host()
    entered, cleaned = asyncio.Event(), asyncio.Event()

    async def stuck(_conn, _args):
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.05)  # a cleanup that takes a while: close() must wait it out
            cleaned.set()

    b.on_request("stuck", stuck)
    async with asyncio.timeout(10):
        conn = await a.connect("127.0.0.1", b.listen_port, b.peer_id)
        call = asyncio.ensure_future(conn.call("stuck", None, timeout=30))
        await entered.wait()
        await b.close()
        assert cleaned.is_set()
        with pytest.raises(PeerUnreachable):
            await call
