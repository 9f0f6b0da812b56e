"""Issue 27, stream layer (items 6 and 9): each attack of ``p2ptrain.testing.hostile.streams`` against a host.

What a peer makes the victim hold is counted through the victim's own stream accounting
(``Connection.streams``), not RSS: deterministic. Each test failed before its defence: tiny frames
each queued a chunk object (65536 of them for a 64 KiB window), empty frames were accepted, a
returned handler's stream stayed open, queued and kept its connection busy, a 1 MiB body decoded to
72 MiB of objects, and a fake refusal byte made a private peer advise dropping its swarm key.
"""

from __future__ import annotations

import asyncio
import tracemalloc

import msgpack
import pytest

from dht import (BootstrapRefused, DHTConfig, DHTNode, Host, Identity, Limits, Multiaddr, PeerUnreachable,
                 ProtocolError)
from dht.pacing import RequestPacer
from dht.stream import COALESCE_BELOW, Stream, held_bound
from dht.swarmkey import SwarmKey
from dht.wire import Kind, unpack
from p2ptrain.testing.hostile import MODES
from p2ptrain.testing.hostile.streams import (
    STREAM_DATA,
    bomb_body,
    fake_swarmkey_refusal,
    msgpack_bomb,
    tiny_frames,
    zombie_streams,
)

KiB = 1 << 10
KEY = SwarmKey(bytes(range(32)))

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("loop_errors")]


def test_every_attack_here_is_a_registered_mode():
    for name in ("tiny_frames", "zombie_streams", "msgpack_bomb", "fake_swarmkey_refusal"):
        assert MODES[name].what
    assert STREAM_DATA == Kind.STREAM_DATA


async def _pair(make, limits: Limits | None = None):
    """(victim, attacker's connection to it, the victim's end of that connection)."""
    victim, attacker = await make(limits), await make()
    conn = await attacker.connect("127.0.0.1", victim.listen_port, victim.peer_id)
    assert await conn.call("echo", 0) == 0  # (the victim has registered its end)
    return victim, conn, victim.connection(attacker.peer_id)


def _holding(victim: Host) -> tuple[list[Stream], asyncio.Event, asyncio.Future]:
    """A "hold" handler on ``victim`` that reads nothing until released, then reads to the end:
    the streams it got, the release, and what it read."""
    got: list[Stream] = []
    release = asyncio.Event()
    read = asyncio.get_running_loop().create_future()

    async def hold(stream: Stream) -> None:
        got.append(stream)
        await release.wait()
        read.set_result(bytes(await stream.read_all(1 << 30, timeout=10)))

    victim.on_stream("hold", hold)
    return got, release, read


# ------------------------------------------------------------------ item 6: stream memory


async def test_tiny_frames_cost_their_bytes_not_an_object_each(make_host):
    """A 32 KiB window sent as 32768 one-byte frames: queued as one chunk (it was 32768 chunk
    objects, ~300 bytes each: ~10 MiB for 32 KiB), within the bound Limits states."""
    window = 32 * KiB
    victim, conn, vconn = await _pair(make_host, Limits(stream_window=window, request_rate=0))  # (unpaced)
    got, release, read = _holding(victim)
    stream = await tiny_frames(conn, "hold", frames=window, size=1)
    assert await conn.call("echo", 1) == 1  # frames are ordered: every data frame was handled
    assert len(got) == 1 and vconn.streams.queued_bytes == window
    assert vconn.streams.queued_chunks <= 2 * window // COALESCE_BELOW + 1  # (it was `window`)
    assert vconn.streams.held_bytes <= held_bound(window)
    assert victim.limits.peer_stream_memory(window) == victim.limits.max_inbound_streams * held_bound(window)
    release.set()
    stream.write_eof()
    assert await asyncio.wait_for(read, 10) == b"x" * window  # the bytes themselves are intact


async def test_tiny_frames_and_stream_opens_are_paced_like_requests(make_host):
    """Each small frame or stream open costs about a request: past the rate, the victim stops
    reading the peer (what is in hand is still taken), and opens over it are reset "busy"."""
    victim, conn, vconn = await _pair(make_host, Limits(request_rate=1000, request_burst=100))
    got, release, read = _holding(victim)
    release.set()
    stream = await tiny_frames(conn, "hold", frames=1000, size=1)  # 250 tokens' worth
    stream.write_eof()
    assert await asyncio.wait_for(read, 10) == b"x" * 1000  # every byte arrives, paced
    assert vconn.throttled_s > 0
    victim, conn, _ = await _pair(make_host, Limits(request_rate=1000, request_burst=3))
    _holding(victim)[1].set()
    opened = [await conn.open_stream("hold") for _ in range(10)]  # sent at once: read at once
    refused = 0
    for s in opened:
        s.write_eof()
        try:
            await s.read(timeout=5)
        except PeerUnreachable as e:
            refused += "busy: more requests" in str(e)
    assert refused >= 5


def test_the_pacer_waits_out_what_one_read_spent_past_the_burst():
    """Frames handled after the bucket ran dry (the rest of one read) are a debt: the peer is
    left unread until it is paid, not only until the next token (which let ~50k tiny frames a
    second through a 1000/s limit)."""
    pacer = RequestPacer(burst=5, now=0.0)
    spent = [pacer.spend(0.0, rate=100, burst=5) for _ in range(10)]
    assert [ok for ok, _ in spent] == [True] * 5 + [False] * 5
    assert spent[-1][1] == pytest.approx(0.06)  # 5 tokens of debt + the next one, at 100/s
    assert pacer.due(0.03, rate=100, burst=5) == pytest.approx(0.03)
    assert pacer.due(0.06, rate=100, burst=5) == 0.0


async def test_coalesced_frames_read_back_in_order(make_host):
    """Frames of every size, small ones copied together, big ones not: the bytes read back are
    the bytes sent, and big frames still arrive as their own chunks."""
    victim, attacker = await make_host(), await make_host()
    received = asyncio.get_running_loop().create_future()

    async def sink(stream: Stream) -> None:
        sizes, data = [], bytearray()
        while (chunk := await stream.read(timeout=10)) is not None:
            sizes.append(len(chunk))
            data += chunk
        received.set_result((sizes, bytes(data)))

    victim.on_stream("sink", sink)
    conn = await attacker.connect("127.0.0.1", victim.listen_port, victim.peer_id)
    stream = await conn.open_stream("sink")
    pieces = [bytes([i % 251]) * n for i, n in enumerate([1, 7, 300, 70 * KiB, 5, 1 << 20, 2, 3, 64 * KiB])]
    for p in pieces:
        await stream.write(p, timeout=10)
    stream.write_eof()
    sizes, data = await asyncio.wait_for(received, 10)
    assert data == b"".join(pieces)
    assert 1 << 20 in sizes and 70 * KiB in sizes


async def test_empty_data_frames_close_the_connection(make_host):
    """An empty frame counted nothing against the window and still cost a queued chunk."""
    victim, conn, vconn = await _pair(make_host)
    _holding(victim)
    await tiny_frames(conn, "hold", frames=3, size=0)
    with pytest.raises(PeerUnreachable):
        await conn.call("echo", 1, timeout=5)
    assert vconn.is_closed and "empty stream data frame" in vconn.close_reason
    fresh = await make_host()  # the victim serves everyone else
    assert await fresh.call(victim.peer_id, ("127.0.0.1", victim.listen_port), "echo", "ok") == "ok"


async def test_a_returned_handlers_stream_is_reset_and_its_connection_can_idle(make_host):
    """Streams whose handler returned: what the peer keeps writing is not queued, the streams
    leave the count (and the host's window budget), and the connection is no longer busy."""
    window = 256 * KiB
    victim, conn, vconn = await _pair(make_host, Limits(stream_window=window))
    done = asyncio.Event()

    async def quick(stream: Stream) -> None:  # answers nothing, reads nothing
        done.set()

    victim.on_stream("quick", quick)
    await zombie_streams(conn, "quick", streams=4, data=window, handler_done=done)
    assert await conn.call("echo", 1) == 1  # frames are ordered: all the junk was handled
    assert len(vconn.streams) == 0 and vconn.streams.queued_bytes == 0
    assert victim.inbound_stream_memory == 0
    assert not vconn.busy  # so the idle timeout can close it


async def test_what_a_returned_handler_left_unread_is_dropped(make_host):
    """The peer sent data and its end, the handler returned without reading them: the stream
    must not stay in the count holding them (it is ended both ways, yet not drained)."""
    victim, conn, vconn = await _pair(make_host)
    go = asyncio.Event()

    async def ignore(stream: Stream) -> None:
        await go.wait()

    victim.on_stream("ignore", ignore)
    stream = await conn.open_stream("ignore")
    await stream.write(bytes(100 * KiB), timeout=5)
    stream.write_eof()
    assert await conn.call("echo", 1) == 1  # the data and the end are queued on the victim
    assert vconn.streams.queued_bytes == 100 * KiB
    go.set()
    assert await stream.read(timeout=5) is None  # the handler's end: it has returned
    assert await conn.call("echo", 2) == 2
    assert len(vconn.streams) == 0 and vconn.streams.queued_bytes == 0 and not vconn.busy


async def test_an_honest_reply_survives_the_handlers_reset(make_host):
    """The reset that follows a returned handler leaves its complete reply readable to the
    opener, which never ended its own side."""
    victim, attacker = await make_host(), await make_host()
    answered = asyncio.Event()

    async def answer(stream: Stream) -> None:
        await stream.write(b"reply" * 1000)
        answered.set()  # (the reset follows in the same step, before any other frame)

    victim.on_stream("answer", answer)
    conn = await attacker.connect("127.0.0.1", victim.listen_port, victim.peer_id)
    stream = await conn.open_stream("answer")
    await answered.wait()
    assert await conn.call("echo", 1) == 1  # its answer came after the reply, end and reset
    assert stream.closed  # reset by the victim: read nothing yet
    assert bytes(await stream.read_all(1 << 20, timeout=5)) == b"reply" * 1000
    with pytest.raises(PeerUnreachable):  # but nobody reads what we would write now
        await stream.write(b"more", timeout=5)
    assert len(conn.streams) == 0


# ------------------------------------------------------------------ item 9: msgpack expansion


def _lists_of(item: bytes, size: int = (1 << 20) - 64) -> bytes:
    """A msgpack body of about ``size`` bytes: arrays of 60000 copies of the packed ``item``."""
    inner = b"\xdd" + (60_000).to_bytes(4, "big") + item * 60_000
    k = size // len(inner)
    return b"\xdd" + k.to_bytes(4, "big") + inner * k


@pytest.mark.parametrize("body", [
    pytest.param(msgpack.packb(bomb_body(), use_bin_type=True), id="empty maps (msgpack_bomb)"),
    pytest.param(_lists_of(b"\x90"), id="empty lists"),
    pytest.param(_lists_of(b"\xe0"), id="small negative ints"),
    pytest.param(_lists_of(b"\xd0\x80"), id="int8"),
    pytest.param(_lists_of("\u0100".encode().join([b"\xa2", b""])), id="1-char non-Latin strings"),
])
def test_a_msgpack_body_decodes_to_a_bounded_size(body):
    """What wire.unpack states: a ~1 MiB body is refused or decodes to at most ~28x its size (1 MiB
    of empty maps decoded to 72 MiB), with a one-line reason when refused."""
    tracemalloc.start()
    try:
        try:
            decoded = unpack(body)
        except ProtocolError as e:
            assert "decodes to more than" in str(e)
            decoded = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 30 * len(body), (decoded is None, peak / len(body))


def test_honest_shapes_still_decode():
    """The bound leaves real messages alone: a full DHT value of small ints, lists of records."""
    value = msgpack.packb(list(range(120)) * 500, use_bin_type=True)  # ~60 KiB of 1-byte ints
    records = msgpack.packb([[bytes(32), None, bytes(200), 1.7e9, bytes(64)] for _ in range(3000)])
    assert len(unpack(value)) == 60_000 and len(unpack(records)) == 3000


async def test_a_msgpack_bomb_request_drops_only_that_connection(make_host):
    victim, conn, vconn = await _pair(make_host)
    with pytest.raises(PeerUnreachable):
        await msgpack_bomb(conn, "echo")
    assert vconn.is_closed and "decodes to more than" in vconn.close_reason
    fresh = await make_host()
    assert await fresh.call(victim.peer_id, ("127.0.0.1", victim.listen_port), "echo", "ok") == "ok"


# ------------------------------------------------------------------ item 9: the refusal byte


@pytest.mark.parametrize("code, our_key, says, not_says", [
    (3, KEY, "the peer says that swarm is public", "drop --swarm-key-file"),
    (2, KEY, "not authenticated", "drop --swarm-key-file"),
    (1, KEY, "does not fit this peer's own swarm key setting", "needs --swarm-key-file"),
    (3, None, "does not fit this peer's own swarm key setting", "drop --swarm-key-file"),
])
async def test_a_fake_refusal_is_reported_as_the_peers_word(code, our_key, says, not_says):
    """Anyone at an address can send the refusal byte: a private peer never advises dropping its
    key on that word, and a code that contradicts its own setting is called bogus."""
    server = await fake_swarmkey_refusal(code)
    port = server.sockets[0].getsockname()[1]
    node = DHTNode(config=DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0), swarm_key=our_key)
    try:
        with pytest.raises(BootstrapRefused) as refused:
            await node.start([Multiaddr.from_host_port("127.0.0.1", port, Identity().peer_id)])
        assert says in str(refused.value) and not_says not in str(refused.value)
    finally:
        server.close()
        await server.wait_closed()
        await node.close()
