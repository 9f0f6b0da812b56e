"""Fuzz every network message handler a peer registers, and the frame layer under them.

The target is a real training peer: a ``p2ptrain.DHT`` with a ``DecentralizedOptimizer`` on it, so
the handlers fuzzed are exactly those a running peer serves. ``test_every_registered_handler_is_fuzzed``
compares what the host has registered with the fuzz tables below: a new RPC method or stream
protocol without a fuzz entry fails it.

For every example (hypothesis; a few hundred per handler) the checks are the same:

* the handler answers with a response or an error, or ends/resets the stream, promptly: no hang,
  no dropped connection, and never "internal error" (an exception the handler did not expect);
* nothing is logged at ERROR and nothing reaches the event loop's exception handler;
* the peer keeps serving: a ping on the same client afterwards succeeds;
* memory does not jump (tracemalloc peak per example): no allocation sized by what a peer claims.

Then the raw frame layer: garbage and truncated handshakes, and after a genuine handshake, frames
of any kind with authentic encryption but hostile content, oversize length prefixes and deep msgpack.
Finally, DHT spam over the network (many keys, huge values, many sub-keys, forged owner records)
must stay bounded by the storage quotas and signatures.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import struct
import time
import tracemalloc
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dht import DHTConfig, DHTNode, Identity, PeerUnreachable, RPCError, RPCTimeout
from dht.connection import DEFAULT_PROLOGUE
from dht.noise import XXHandshake
from dht.storage import Record, owned_name, sign_record
from dht.stream import StreamReset
from dht.transport import Host
from dht.wire import HEADER_SIZE, LENGTH, MAX_MESSAGE, Kind, pack, parse_header

pytestmark = pytest.mark.timeout(240)

RUN_ID = "fuzz"
PREFIX = f"{RUN_ID}/sync"
STATE_KEY = f"{PREFIX}/state"
MEMORY_LIMIT = 32 << 20  # bytes a single hostile message may make the process allocate at peak
FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


# ------------------------------------------------------------------ the target peer


class Target:
    """A training peer on its own loop thread, a client host on the same loop, and what went wrong."""

    def __init__(self) -> None:
        import p2ptrain
        from p2ptrain import DecentralizedOptimizer

        self.errors: list[str] = []
        self._handler = _Collect(self.errors)
        logging.getLogger().addHandler(self._handler)
        self.dht = p2ptrain.DHT([], swarm_key=False)
        self.dht.loop.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(f"loop: {ctx.get('message')} "
                                                                                      f"{ctx.get('exception')!r}"))
        self.model = torch.nn.Linear(8, 4)
        self.opt = DecentralizedOptimizer(torch.optim.SGD(self.model.parameters(), lr=0.1), dht=self.dht,
                                          run_id=RUN_ID, target_batch_size=64, batch_size_per_step=8,
                                          matchmaking_timeout=0.5)
        self.host = self.dht.node.host
        # the fuzzer sends thousands of requests on one connection as fast as answers come:
        # unpaced here (the pacing itself is tested in test_transport)
        self.host.limits.request_rate = 0
        self.service = self.opt.averager.service
        self.service.accept_wait = 0.01  # streams of unknown groups are reset at once, not after 5 s
        self.port = self.host.listen_port
        self.client = Host(Identity(), None)
        self.run(self.client.start())
        self.schema_hash = self.opt.averager.schema.hash
        self.manifest_id, self.num_chunks = self.run(self._manifest())

    async def _manifest(self) -> tuple[bytes, int]:
        reply = await self.client.call(self.host.peer_id, ("127.0.0.1", self.port), "p2ptrain.state.manifest",
                                       {"key": STATE_KEY})
        from p2ptrain.checkpoint.manifest import Manifest

        return reply["id"], Manifest.from_bytes(reply["manifest"]).num_chunks

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self.dht.run(coro, timeout)

    async def conn(self):
        return await self.client.connect("127.0.0.1", self.port, self.host.peer_id, timeout=5.0)

    def close(self) -> None:
        try:
            self.run(self.client.close())
            self.opt.close()
        finally:
            self.dht.close()
            logging.getLogger().removeHandler(self._handler)


class _Collect(logging.Handler):
    def __init__(self, out: list[str]):
        super().__init__(logging.ERROR)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(f"{record.name}: {record.getMessage()} {record.exc_text or ''}")


@pytest.fixture(scope="module")
def target():
    t = Target()
    try:
        yield t
    finally:
        t.close()


def _example(target: Target, coro_fn, *args) -> Any:
    """Run one fuzz example on the target's loop and apply the common checks. Allocations are
    traced only while the example runs (tracing hypothesis's own work would triple its cost)."""
    target.errors.clear()
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    try:
        outcome = target.run(coro_fn(target, *args))
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        if not tracing:
            tracemalloc.stop()
    alive = target.run(_ping(target))
    assert alive is None, f"the peer stopped serving after {args!r:.300}"
    assert target.errors == [], f"{args!r:.500} -> {target.errors}"
    assert peak - before < MEMORY_LIMIT, f"{args!r:.300} made the process allocate {(peak - before) >> 20} MiB"
    return outcome


async def _ping(target: Target) -> Any:
    conn = await target.conn()
    return await conn.call("ping", None, timeout=5.0)


# ------------------------------------------------------------------ strategies

INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**64 - 1, -(2**63)])
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -1e308, 5e-324, -0.0])
SCALARS = (st.none() | st.booleans() | INT64 | EDGE_INTS | FLOATS | st.text(max_size=40)
           | st.binary(max_size=80))
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10) | INT64, inner, max_size=6),
    max_leaves=30,
)


def deep(depth: int) -> Any:
    obj: Any = None
    for i in range(depth):
        obj = [obj] if i % 2 else {"a": obj}
    return obj


DEEP = st.integers(min_value=50, max_value=500).map(deep)  # msgpack packs at most 511 levels
ANY = JUNK | DEEP


def mutated(base: dict, values: st.SearchStrategy = JUNK) -> st.SearchStrategy:
    """``base`` with some fields replaced by junk, some dropped, and unknown keys added."""
    keys = sorted(base)
    return st.builds(
        lambda replace, drop, extra: {**{k: v for k, v in base.items() if k not in drop}, **replace, **extra},
        st.dictionaries(st.sampled_from(keys), values, max_size=len(keys)),
        st.sets(st.sampled_from(keys), max_size=2),
        st.dictionaries(st.text(min_size=1, max_size=8), JUNK, max_size=2),
    )


NAME = st.binary(max_size=64) | st.builds(lambda b, p: owned_name(b, p), st.binary(max_size=20),
                                           st.just(Identity().peer_id)) | st.just(b"x[owner:garbage]")
RECORD = st.builds(
    lambda k, s, v, e, sig: [k, s, v, e, sig],
    NAME | JUNK, st.none() | NAME | JUNK, st.binary(max_size=256) | JUNK,
    st.floats(allow_nan=True) | INT64 | st.just(time.time() + 60) | JUNK,
    st.none() | st.binary(min_size=64, max_size=64) | JUNK,
)


def _rpc_strategies(target: Target) -> dict[str, st.SearchStrategy]:
    member = st.builds(lambda pid, addr, bw: [pid, addr, bw],
                       st.just(target.client.peer_id.to_bytes()) | st.binary(max_size=40) | JUNK,
                       st.none() | st.just(["127.0.0.1", 4001]) | st.lists(JUNK, max_size=3) | JUNK,
                       FLOATS | INT64 | JUNK)
    join = {"prefix": PREFIX, "v": 1, "round": "7", "schema": target.schema_hash, "remaining": 0.2,
            "member": [target.client.peer_id.to_bytes(), None, 1.0]}
    me, relay = target.client.peer_id, target.host.peer_id
    circuit = f"/ip4/127.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{me}"
    circuits = st.lists(st.just(circuit) | st.text(max_size=300) | JUNK, max_size=6) | JUNK
    return {
        "autonat.dial": ANY | mutated({"port": 1}, EDGE_INTS | st.integers(1, 65535) | JUNK),
        "host.addrs": ANY | mutated({"port": 4001, "relays": [circuit]}, circuits | EDGE_INTS),
        "ping": ANY,
        "find_node": ANY | st.binary(min_size=30, max_size=34),
        "find_value": ANY | st.binary(max_size=1100)
        | st.tuples(st.binary(max_size=1100), st.binary(max_size=40) | JUNK, st.binary(max_size=2100) | JUNK).map(list)
        | st.tuples(st.binary(max_size=40), st.binary(max_size=40), st.just(b""),
                    EDGE_INTS | st.floats() | JUNK).map(list),
        "store": ANY | st.lists(RECORD | JUNK, max_size=8)
        | st.integers(250, 300).map(lambda n: [[b"k%d" % i, None, b"\xc0", time.time() + 60, None] for i in range(n)])
        | st.fixed_dictionaries({"r": st.lists(RECORD | JUNK, max_size=4) | JUNK, "n": EDGE_INTS | JUNK}),
        "notice": ANY | st.binary(max_size=1100)
        | st.tuples(st.binary(max_size=1100) | JUNK, st.lists(RECORD | JUNK, max_size=6) | JUNK).map(list),
        "p2ptrain.mm.join": ANY | mutated(join) | mutated(join, member | st.just(-1.0) | st.just(1e9)),
        "p2ptrain.state.manifest": ANY | mutated({"key": STATE_KEY}),
        "p2ptrain.ar.left": ANY | mutated({"g": [os.urandom(16)]},
                                          st.lists(st.binary(max_size=80) | JUNK, max_size=300) | JUNK),
    }


def _stream_strategies(target: Target) -> dict[str, st.SearchStrategy]:
    idents = st.just(target.manifest_id) | st.binary(max_size=40) | JUNK
    state = {"key": STATE_KEY, "id": target.manifest_id}
    chunks = {**state, "first": 0, "count": 1}
    counts = EDGE_INTS | st.integers(min_value=-3, max_value=target.num_chunks + 3) | JUNK
    allreduce = {"g": os.urandom(16), "from": 1, "w": 1.0, "n": 512, "codec": "none()", "gcodec": "none()"}
    return {
        "p2ptrain.state.manifest/1": ANY | mutated(state, idents),
        "p2ptrain.state.chunks/1": ANY | mutated(chunks, counts) | mutated(chunks, idents),
        "p2ptrain/allreduce/1": ANY | mutated(allreduce),
        "p2ptrain/allreduce-audit/1": ANY | mutated({"g": os.urandom(16),
                                                     "q": [["s", 0, 0, 0, 1], ["r", 0, 1, 3, 16]]}),
    }


#: every handler a peer registers, and how it is fuzzed (the keys are checked against the host)
RPC_METHODS = {"autonat.dial", "host.addrs", "ping", "find_node", "find_value", "store", "notice", "p2ptrain.mm.join",
               "p2ptrain.state.manifest", "p2ptrain.ar.left"}
STREAM_PROTOCOLS = {"p2ptrain.state.manifest/1", "p2ptrain.state.chunks/1", "p2ptrain/allreduce/1",
                    "p2ptrain/allreduce-audit/1"}


def test_every_registered_handler_is_fuzzed(target):
    assert set(target.host._handlers) == RPC_METHODS == set(_rpc_strategies(target))
    assert set(target.host._stream_handlers) == STREAM_PROTOCOLS == set(_stream_strategies(target))


# ------------------------------------------------------------------ RPC handlers


async def _call(target: Target, method: str, args: Any) -> tuple[str, Any]:
    conn = await target.conn()
    try:
        return "ok", await conn.call(method, args, timeout=5.0)
    except RPCError as e:
        return "error", str(e)
    except RPCTimeout:
        return "timeout", None
    except PeerUnreachable as e:
        return "closed", str(e)


def _check_rpc(outcome: tuple[str, Any], method: str, args: Any) -> None:
    kind, detail = outcome
    assert kind in ("ok", "error"), f"{method}({args!r:.300}) -> {kind}: {detail}"
    if kind == "error":
        assert "internal error" not in detail, f"{method}({args!r:.300}) -> {detail}"


@pytest.mark.parametrize("method", sorted(RPC_METHODS))
def test_fuzz_rpc_handler(target, method):
    strategy = _rpc_strategies(target)[method]

    @FUZZ
    @given(args=strategy)
    def run(args):
        _check_rpc(_example(target, _call, method, args), method, args)

    run()


# ------------------------------------------------------------------ stream handlers


async def _stream(target: Target, protocol: str, header: Any, data: bytes, end: str) -> tuple[str, Any]:
    conn = await target.conn()
    stream = await conn.open_stream(protocol, header)
    try:
        if data:
            await stream.write(data, timeout=5.0)
        if end == "eof":
            stream.write_eof()
        elif end == "reset":
            stream.reset("fuzzer gives up")
            return "reset-by-us", None
        got = 0
        while (chunk := await stream.read(timeout=5.0)) is not None:
            got += len(chunk)
        return "eof", got
    except StreamReset as e:
        return "reset", str(e)
    except RPCTimeout as e:
        return "timeout", str(e)
    finally:
        if not stream.closed:
            stream.reset("done")


def _check_stream(outcome: tuple[str, Any], protocol: str, header: Any) -> None:
    kind, detail = outcome
    assert kind in ("eof", "reset", "reset-by-us"), f"{protocol} {header!r:.300} -> {kind}: {detail}"
    if kind == "reset":
        assert "internal error" not in detail, f"{protocol} {header!r:.300} -> {detail}"


@pytest.mark.parametrize("protocol", sorted(STREAM_PROTOCOLS))
def test_fuzz_stream_handler(target, protocol):
    strategy = _stream_strategies(target)[protocol]

    @FUZZ
    @given(header=strategy, data=st.binary(max_size=5000), end=st.sampled_from(["eof", "eof", "reset", "none"]))
    def run(header, data, end):
        if end == "none" and protocol == "p2ptrain/allreduce/1":
            end = "eof"  # an owner legitimately waits (bounded by its stall timeout) for more data
        _check_stream(_example(target, _stream, protocol, header, data, end), protocol, header)

    run()


_BASE_HEADER = {"from": 1, "w": 1.0, "n": 512, "codec": "none()", "gcodec": "none()"}


async def _live_round(target: Target, header_changes: dict, data: bytes, end: str) -> tuple[Any, Any]:
    """The target owns the whole vector in a round with the fuzzer as its only other member; the
    fuzzer's stream gets a plausible header (with ``header_changes``) and ``data``."""
    from p2ptrain.averaging import AllReduceConfig
    from p2ptrain.averaging.group import Group, Member

    gid = os.urandom(16)
    group = Group(gid, (Member(target.host.peer_id, ("127.0.0.1", target.port)), Member(target.client.peer_id, None)))
    flat = torch.ones(512)
    cfg = AllReduceConfig(timeout=2.0, join_timeout=1.0, stall_timeout=0.5)
    owner = asyncio.ensure_future(target.service.run(group, 0, flat, weight=1.0, codec="none", config=cfg))
    header = {"g": gid, **_BASE_HEADER, **header_changes}
    for key in [k for k, v in header.items() if v is _DROP]:
        del header[key]
    try:
        sent = await _stream(target, "p2ptrain/allreduce/1", header, data, end)
    finally:
        result = await owner
    return sent, result


_DROP = object()


def _valid_header(header: dict) -> bool:
    """The owner's header rules, restated: the same keys; our rank, our numel and our codecs (equal
    in value: msgpack may carry 1 as 1.0); a declared weight that is a number in (0, max_weight]
    (any, not just the usual 1.0: a sender may count many samples)."""
    from p2ptrain.averaging import AllReduceConfig

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return (set(header) == set(_BASE_HEADER) and number(header["from"]) and header["from"] == 1
            and number(header["n"]) and header["n"] == 512 and number(header["w"])
            and 0 < header["w"] <= AllReduceConfig().max_weight
            and header["codec"] == header["gcodec"] == "none()")


@settings(FUZZ, max_examples=60)
@given(changes=st.dictionaries(st.sampled_from(["from", "w", "n", "codec", "gcodec", "extra"]),
                               JUNK | EDGE_INTS | FLOATS | st.just(_DROP), max_size=2),
       data=st.binary(max_size=3000) | st.binary(min_size=2048, max_size=2048)
       | st.builds(lambda i, v: struct.pack("<512f", *[v if j == i else 0.5 for j in range(512)]),
                   st.integers(0, 511), st.sampled_from([math.inf, -math.inf, math.nan, 0.25, 3e38])),
       end=st.sampled_from(["eof", "eof", "reset"]))
# headers that differ from the usual one and are still valid (the first was once taken for hostile)
@example(changes={"w": 2**31 - 1}, data=bytes(2048), end="eof")
@example(changes={"from": 1.0, "n": 512.0}, data=struct.pack("<512f", *[0.25] * 512), end="eof")
# a weight that would overflow a weighted float32 sum: the owner's running mean takes it
@example(changes={"w": 1e12}, data=struct.pack("<512f", *[3e26] * 512), end="eof")
@example(changes={}, data=struct.pack("<512f", *[2e38] * 512), end="eof")  # beyond the mean's bound
def test_fuzz_allreduce_inside_a_live_round(target, changes, data, end):
    """A hostile member of a real round: the owner finishes the round, drops the member unless its
    part was valid (averaging it in when it was), and never raises or logs an error. Valid: a header
    the owner's rules accept, exactly one part of finite values within the owner's bound for a
    ``none`` round (|x| <= half of float32's max: its running mean of such values cannot overflow,
    whatever the weights)."""
    from p2ptrain.averaging.reducer import SUM_LIMIT as _SUM_LIMIT

    sent, result = _example(target, _live_round, changes, data, end)
    assert sent[0] in ("eof", "reset", "reset-by-us"), sent
    header = {k: v for k, v in {**_BASE_HEADER, **changes}.items() if v is not _DROP}
    values = struct.unpack("<512f", data) if len(data) == 2048 else ()
    valid = (_valid_header(header) and end == "eof" and len(data) == 2048 and all(math.isfinite(x) for x in values)
             and max(map(abs, values)) <= _SUM_LIMIT)
    if valid:
        # the reply: a length-prefixed summary, then the averaged 512 float32 values
        assert result.failed == {} and sent[0] == "eof" and sent[1] > 2048, (sent, result.failed)
    else:
        assert 1 in result.failed, (changes, len(data), end, result.failed)


# ------------------------------------------------------------------ the frame layer


async def _raw_exchange(target: Target, data: bytes, handshake: bool, frames: list[tuple[int, int, bytes]]) -> None:
    """Open a raw TCP connection; optionally do a genuine handshake first, then send authentically
    encrypted frames (kind, id, body) and/or ``data`` as is; then close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
    try:
        if handshake:
            hs = XXHandshake(Identity(), True, prologue=DEFAULT_PROLOGUE, expected_peer=target.host.peer_id,
                             local_payload={"port": None})
            m1 = hs.write_message()
            writer.write(struct.pack(">H", len(m1)) + m1)
            (n,) = struct.unpack(">H", await asyncio.wait_for(reader.readexactly(2), 5))
            hs.read_message(await asyncio.wait_for(reader.readexactly(n), 5))
            m3 = hs.write_message()
            writer.write(struct.pack(">H", len(m3)) + m3)
            for kind, ident, body in frames:
                header = struct.pack(">BBHI", kind, 0, 0, ident)
                ct = hs.send_cipher.encrypt(header, body)
                writer.write(LENGTH.pack(HEADER_SIZE + len(ct)) + header + ct)
        writer.write(data)
        await writer.drain()
        # read what the peer answers (or its close) for a moment, never blocking the example long
        try:
            async with asyncio.timeout(0.01):
                while await reader.read(65536):
                    pass
        except TimeoutError:
            pass
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the target closed on us: fine, it only has to survive
    finally:
        writer.close()


@FUZZ
@given(data=st.binary(max_size=300)
       | st.builds(lambda n, rest: struct.pack(">H", n) + rest, st.integers(0, 65535), st.binary(max_size=120))
       | st.builds(lambda rest: struct.pack(">H", 48) + rest, st.binary(min_size=0, max_size=60)))
def test_fuzz_bytes_before_the_handshake(target, data):
    _example(target, _raw_exchange, data, False, [])


KINDS = st.sampled_from([int(k) for k in Kind]) | st.integers(0, 255)
BODIES = (st.binary(max_size=200) | JUNK.map(pack)
          | st.builds(lambda m, a: pack([m, None])[:-1] + a, st.sampled_from(sorted(RPC_METHODS)),
                      st.binary(max_size=50))
          | st.just(b"\x91" * 5000 + b"\xc0")  # 5000 nested arrays
          | st.just(b"\xdd\xff\xff\xff\xff")  # an array claiming 4 billion items
          | st.just(b"\xc6\x7f\xff\xff\xff"))  # a bin claiming 2 GiB
FRAMES = st.lists(st.tuples(KINDS, st.integers(0, 2**32 - 1) | st.integers(0, 8), BODIES), max_size=4)
AFTER = (st.just(b"") | st.binary(max_size=100)
         | st.builds(lambda n: LENGTH.pack(n), st.sampled_from([0, 7, 2**31, 2**32 - 1, 5 << 20, 4 << 20]))
         | st.builds(lambda n, rest: LENGTH.pack(n) + rest, st.integers(8, 200), st.binary(max_size=100)))


@FUZZ
@given(frames=FRAMES, after=AFTER)
def test_fuzz_frames_after_a_genuine_handshake(target, frames, after):
    _example(target, _raw_exchange, after, True, frames)


def test_frames_with_hostile_msgpack_close_only_that_connection(target):
    """Deterministic companions of the fuzz above, each checked on its own."""
    for body in (b"\x91" * 5000 + b"\xc0", b"\xdd\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff",
                 msgpack.packb(["ping", None])[:-1], b"\x92\xa4ping\xdd\x00\x01\x00\x00"):
        for kind in (Kind.REQUEST, Kind.STREAM_OPEN, Kind.RESPONSE, Kind.ERROR, Kind.STREAM_RESET, Kind.GOAWAY):
            _example(target, _raw_exchange, b"", True, [(int(kind), 1, body)])


def test_header_parsing_rejects_unknown_kinds():
    for kind in (0, 11, 255):
        with pytest.raises(Exception, match="unknown frame kind"):
            parse_header(struct.pack(">BBHI", kind, 0, 0, 1))


# ------------------------------------------------------------------ DHT spam over the network


SPAM_CONFIG = DHTConfig(rpc_timeout=2.0, bootstrap_timeout=2.0, maintenance_period=0.5, max_records_per_source=100)


@pytest.fixture
async def spam_target(loop_errors):
    node = DHTNode(config=SPAM_CONFIG)
    await node.start()
    spammer = Host(Identity(), None)
    await spammer.start()
    try:
        yield node, spammer
    finally:
        await spammer.close()
        await node.close()


async def _store(spammer: Host, node: DHTNode, records: list[list]) -> list:
    return await spammer.call(node.peer_id, ("127.0.0.1", node.host.listen_port), "store", records, timeout=10)


def _rec(key: bytes, value: bytes = b"\xa1v", subkey: bytes | None = None, ttl: float = 60.0) -> Record:
    return Record(key, subkey, value, time.time() + ttl)


async def test_many_keys_from_one_peer_are_capped_by_its_quota(spam_target):
    node, spammer = spam_target
    async with asyncio.timeout(30):
        replies = []
        for batch in range(4):
            replies += await _store(spammer, node, [_rec(f"spam/{batch}/{i}".encode()).to_wire() for i in range(250)])
        assert replies.count(True) == SPAM_CONFIG.max_records_per_source
        assert all(r is True or "too many records from peer" in r for r in replies)
        assert len(node.storage) == SPAM_CONFIG.max_records_per_source
        # an honest peer still has its own quota
        honest = DHTNode(config=SPAM_CONFIG)
        try:
            await honest.start(node.multiaddrs)
            assert await honest.store("honest/key", "v", time.time() + 60) >= 2
            got = await DHTNode.get(honest, "honest/key")
            assert got is not None and got.value == "v"
        finally:
            await honest.close()


async def test_huge_values_and_oversize_messages_are_refused(spam_target):
    node, spammer = spam_target
    async with asyncio.timeout(30):
        big = _rec(b"big", b"x" * (SPAM_CONFIG.max_value_size + 1)).to_wire()
        (reply,) = await _store(spammer, node, [big])
        assert "exceeds" in reply and len(node.storage) == 0
        with pytest.raises(PeerUnreachable):  # a request over the 1 MiB message limit: connection dropped
            await _store(spammer, node, [_rec(b"k%d" % i, b"x" * 60_000).to_wire() for i in range(20)])
        assert len(node.storage) == 0
        assert await _store(spammer, node, [_rec(b"after").to_wire()]) == [True]  # serves a new connection


async def test_many_large_subkeys_do_not_break_reads_of_the_key(spam_target):
    """A spammer fills one key with big sub-keys; find_value of that key must still answer (within
    the 1 MiB message limit) instead of sending a reply the reader drops the connection over."""
    node, spammer = spam_target
    async with asyncio.timeout(30):
        value = msgpack.packb("x" * 60_000)
        for i in range(0, 60, 10):
            replies = await _store(spammer, node,
                                   [_rec(b"round/7", value, b"s%d" % j).to_wire() for j in range(i, i + 10)])
            assert all(r is True for r in replies)
        reader = DHTNode(config=SPAM_CONFIG, listen=None)
        try:
            await reader.start(node.multiaddrs)
            got = await reader.get("round/7", latest=True)
            assert isinstance(got, dict) and 0 < len(got) <= 60
        finally:
            await reader.close()
        assert node.host.connections  # the reader's connection was not torn down by an oversize reply


async def test_forged_owner_records_are_refused_over_the_network(spam_target):
    node, spammer = spam_target
    victim = Identity()
    key = owned_name(b"ckpt/latest", victim.peer_id)
    async with asyncio.timeout(30):
        genuine = sign_record(_rec(key, msgpack.packb({"epoch": 1})), victim)
        assert await _store(spammer, node, [genuine.to_wire()]) == [True]  # anyone may relay a signed record
        forged = [
            _rec(key, msgpack.packb({"epoch": 999}), ttl=120),  # unsigned
            Record(key, None, msgpack.packb({"epoch": 999}), time.time() + 120, b"\x00" * 64),  # bad signature
            sign_record(_rec(key, msgpack.packb({"epoch": 999}), ttl=120), Identity()),  # signed by another peer
            Record(key, None, genuine.value, genuine.expiration + 50, genuine.signature),  # replayed, new expiry
            sign_record(_rec(b"x", subkey=owned_name(b"m", victim.peer_id)), Identity()),  # owned sub-key
        ]
        replies = await _store(spammer, node, [r.to_wire() for r in forged])
        assert all(isinstance(r, str) for r in replies), replies
        (held,) = node.storage.get(key, time.time())
        assert held == genuine
        assert node.storage.get(b"x", time.time()) == []


async def test_reply_over_the_message_limit_is_an_error_not_a_dropped_connection(spam_target):
    node, spammer = spam_target
    async with asyncio.timeout(10):
        node.host.on_request("big", lambda _c, _a: _big_reply())
        conn = await spammer.connect("127.0.0.1", node.host.listen_port, node.peer_id)
        with pytest.raises(RPCError, match="exceeds"):
            await conn.call("big", None)
        assert await conn.call("ping", None) is None  # same connection, still open


async def _big_reply() -> bytes:
    return b"x" * (MAX_MESSAGE + 1)
