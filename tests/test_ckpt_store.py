"""The local checkpoint store: CIDs, signed records, blobs, crash safety, dedupe, gc, export.

Crash tests run a real child process that saves into the same data directory and stops at a
chosen ``os.replace`` (told to the parent through its stdout), where the parent SIGKILLs it or
lets it go on: deterministic, no sleeps.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht import Identity
from p2ptrain.checkpoint import Manifest, build_snapshot, restore
from p2ptrain.checkpoint.cid import CID_LENGTH, cid, parse_cid
from p2ptrain.checkpoint.record import CheckpointRecord, RecordError
from p2ptrain.checkpoint.blobs import CorruptBlobError, MissingBlobError
from p2ptrain.checkpoint.info import AmbiguousCheckpointError, CheckpointNotFound, IncompleteCheckpointError
from p2ptrain.checkpoint.store import CheckpointStore
from p2ptrain.checkpoint.tree import DTYPES

CHUNK = 64 << 10
ME = Identity()


def same(a, b) -> bool:
    """Equality that tells list from tuple and int from bool, and compares tensors bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, float):
        return (a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def raw_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN payloads included)."""
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def model_state(seed: int, frozen_seed: int = 0) -> dict:
    """A 'frozen' tensor shared by every seed (10 chunks) and a head that differs (10 chunks)."""
    g = torch.Generator().manual_seed(frozen_seed)
    frozen = torch.randn(160_000, generator=g)
    g.manual_seed(1000 + seed)
    return {"model": {"frozen": frozen, "head": torch.randn(160_000, generator=g)}, "epoch": seed}


def blob_files(store: CheckpointStore) -> dict[str, int]:
    return {str(p.relative_to(store.blobs.dir)): p.stat().st_size for p in store.blobs.dir.rglob("*") if p.is_file()}


def digests_of(m: Manifest) -> set[str]:
    """The blob names a complete checkpoint of ``m`` occupies."""
    names = {m.chunk_digest(i).hex() for i in range(m.num_chunks)} | {m.id.hex()}
    return {f"{h[:2]}/{h[2:]}" for h in names}


def save(store: CheckpointStore, state, *, run: str = "run", epoch: int = 1, **kw):
    m, buf = build_snapshot(state, chunk_size=CHUNK)
    return m, store.save(m, buf, run_id=run, epoch=epoch, identity=ME, **kw)


# ---------------------------------------------------------------------------------- cid


def test_cid_round_trip_hex_and_canonical_form():
    d = bytes(range(32))
    c = cid(d)
    assert c.startswith("bafkr4i") and len(c) == CID_LENGTH
    assert parse_cid(c) == d and parse_cid(c.upper()) == d and parse_cid(d.hex()) == d and parse_cid(f"  {c}\n") == d
    other = c[:-1] + ("a" if c[-1] != "a" else "b")  # a different last character: stray bits or another digest
    try:
        assert parse_cid(other) != d
    except ValueError as e:
        assert "canonical" in str(e)
    for bad in ["", "x", c[:-1], "bafy" + c[4:], d.hex()[:-1], "z" * CID_LENGTH, c[:-2] + "01"]:
        with pytest.raises(ValueError):
            parse_cid(bad)
    with pytest.raises(ValueError):
        cid(b"short")


# ---------------------------------------------------------------------------------- records


def signed(**kw) -> CheckpointRecord:
    args = {"run_id": "run", "epoch": 3, "manifest_id": bytes(range(32)), "size": 1234, **kw}
    return CheckpointRecord.sign(ME, **args)


def test_record_signs_round_trips_and_detects_tampering():
    r = signed(created=1700000000.5)
    assert r.verify() and r.writer == ME.peer_id
    assert CheckpointRecord.from_bytes(r.to_bytes()) == r
    for field, value in [("run_id", "other"), ("epoch", 4), ("manifest_id", bytes(32)), ("size", 1235),
                         ("created", 1700000001.5), ("writer", Identity().peer_id)]:
        forged = CheckpointRecord(**{**r.__dict__, field: value})
        assert not forged.verify(), field
    other = Identity()  # a validly signed record by someone else is not the writer's
    theirs = CheckpointRecord.sign(other, run_id="run", epoch=3, manifest_id=r.manifest_id, size=1234)
    assert theirs.verify() and not CheckpointRecord(**{**theirs.__dict__, "writer": ME.peer_id}).verify()


def test_record_rejects_bad_fields():
    for kw in [{"run_id": ""}, {"run_id": "a/b"}, {"run_id": "x" * 101}, {"epoch": -1}, {"epoch": 1.0},
               {"manifest_id": b"short"}, {"size": -5}, {"created": float("nan")}]:
        with pytest.raises(RecordError):
            signed(**kw)


def test_newer_than_orders_by_epoch_then_created_then_lower_id():
    a = signed(epoch=2, created=10.0)
    assert a.newer_than(None)
    assert signed(epoch=3, created=1.0).newer_than(a) and not a.newer_than(signed(epoch=3, created=1.0))
    assert signed(epoch=2, created=11.0).newer_than(a)
    lo, hi = (signed(epoch=2, created=10.0, manifest_id=bytes(32)),
              signed(epoch=2, created=10.0, manifest_id=b"\xff" * 32))
    assert lo.newer_than(hi) and not hi.newer_than(lo) and not lo.newer_than(lo)


def _records_differ_or_fail(data: bytes, original: CheckpointRecord) -> None:
    try:
        r = CheckpointRecord.from_bytes(data)
    except RecordError:
        return
    # anything accepted must be canonical, so different bytes are a different record, which
    # the original signature cannot cover
    assert r.to_bytes() == data
    assert data == original.to_bytes() or not r.verify()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=1200))
def test_hostile_record_bytes_raise_record_error_only(data):
    try:
        CheckpointRecord.from_bytes(data)
    except RecordError:
        pass


_ORIGINAL = signed(created=1.25)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(_ORIGINAL.to_bytes()) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_rejected_or_unsigned(pos, xor):
    data = bytearray(_ORIGINAL.to_bytes())
    data[pos] ^= xor
    _records_differ_or_fail(bytes(data), _ORIGINAL)


_values = st.recursive(
    (st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=20)
     | st.binary(max_size=80)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional={k: _values for k in
                                           ("v", "run_id", "epoch", "manifest", "size", "created", "writer", "sig")}),
       st.dictionaries(st.sampled_from(["v", "run_id", "epoch", "manifest", "size", "created", "writer", "sig"]),
                       _values, max_size=8))
def test_well_formed_msgpack_with_wrong_fields_raises_record_error(base, overrides):
    good = msgpack.unpackb(_ORIGINAL.to_bytes(), raw=False)
    good.update(base)
    good.update(overrides)
    try:
        data = msgpack.packb(good, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    _records_differ_or_fail(data, _ORIGINAL)


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_save_load_round_trip_is_bit_exact(tmp_path):
    state = {
        "tensors": {name: raw_tensor(dt, (3, 5), seed=i) for i, (name, dt) in enumerate(sorted(DTYPES.items()))},
        "empty": [torch.empty(0), torch.empty(2, 0, 3, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)],
        "scalar": torch.tensor(7, dtype=torch.int32),
        "big": raw_tensor(torch.float32, (100_000,), seed=99),  # spans chunks
        "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "meta": {"epoch": 4, "nan": float("nan"), "name": "x", "raw": b"\x00\x01", "none": None, "flag": True},
    }
    store = CheckpointStore(tmp_path)
    m, info = save(store, state, epoch=4)
    assert info.cid == cid(m.id) and info.size == m.total_size and m.num_chunks > 2
    fresh = CheckpointStore(tmp_path)  # nothing cached: everything comes from disk
    m2, buffer = fresh.load(info.manifest_id)
    assert m2 == m
    assert same(restore(m2, buffer), state)
    _, tensors = fresh.load_tensors(info.manifest_id)
    from p2ptrain.checkpoint.tree import flatten

    assert all(same(a, b) for a, b in zip(tensors, flatten(state)[1]))
    assert [i.manifest_id for i in fresh.list()] == [m.id] and fresh.latest("run").record == info.record
    assert fresh.verify() == [] and fresh.verify(m.id) == []


def test_empty_state_and_tensorless_state_round_trip(tmp_path):
    store = CheckpointStore(tmp_path)
    for epoch, state in enumerate([{}, {"lr": 0.5, "names": ["a", "b"]}, {"t": torch.empty(0, 4)}]):
        m, info = save(store, state, epoch=epoch)
        assert same(restore(*store.load(info.manifest_id)), state)


def test_identical_chunks_are_stored_once(tmp_path):
    store = CheckpointStore(tmp_path)
    m1, _ = save(store, model_state(1), epoch=1)
    after_first = blob_files(store)
    assert set(after_first) == digests_of(m1)
    m2, _ = save(store, model_state(2), epoch=2)  # same frozen tensor, another head
    files = blob_files(store)
    assert set(files) == digests_of(m1) | digests_of(m2)
    frozen_chunks = 160_000 * 4 // CHUNK  # chunks lying wholly inside the frozen tensor
    shared = {m1.chunk_digest(i) for i in range(m1.num_chunks)} & {m2.chunk_digest(i) for i in range(m2.num_chunks)}
    assert len(shared) >= frozen_chunks
    # on disk: the first checkpoint plus only the second one's new chunks (and its manifest)
    assert sum(files.values()) - sum(after_first.values()) <= m2.total_size - frozen_chunks * CHUNK + len(m2.to_bytes())
    assert len(files) == len(after_first) + (m2.num_chunks - len(shared)) + 1
    # saving the very same state again writes nothing new
    save(store, model_state(2), epoch=3)
    assert blob_files(store) == files


# ---------------------------------------------------------------------------------- corruption


def test_corrupt_chunk_is_detected_removed_and_repairable(tmp_path):
    store = CheckpointStore(tmp_path)
    state = model_state(1)
    m, info = save(store, state)
    chunk = m.chunk_digest(3)
    good = store.read_chunk(m, 3)
    path = store.blobs.path(chunk)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptBlobError):
        store.read_chunk(m, 3)
    assert not path.exists()  # removed: a fetch can put the right bytes back
    with pytest.raises(MissingBlobError, match="chunk 3"):
        store.load(m.id)
    assert store.missing_chunks(m) == [3]
    problems = store.verify()
    assert len(problems) == 1 and "chunk 3" in problems[0] and "missing" in problems[0]

    with pytest.raises(CorruptBlobError):
        store.add_chunk(m, 3, bytes(data))  # wrong bytes are refused
    store.add_chunk(m, 3, good)
    assert store.verify() == [] and same(restore(*store.load(m.id)), state)


def test_verify_and_load_find_a_truncated_blob_and_a_corrupt_manifest(tmp_path):
    store = CheckpointStore(tmp_path)
    m, info = save(store, model_state(1))
    chunk_path = store.blobs.path(m.chunk_digest(0))
    chunk_path.write_bytes(chunk_path.read_bytes()[:-1])
    with pytest.raises(CorruptBlobError):
        CheckpointStore(tmp_path).load(m.id)

    store.blobs.path(m.id).write_bytes(b"\x00" * 10)
    fresh = CheckpointStore(tmp_path)
    problems = fresh.verify()
    assert len(problems) == 1 and "manifest" in problems[0] and info.cid in problems[0]
    # gc cannot tell which chunks the unreadable manifest needed: it deletes no blob
    files = blob_files(fresh)
    result = fresh.gc()
    assert result.problems and blob_files(fresh) == files


# ---------------------------------------------------------------------------------- records on disk


def test_forged_tampered_and_misfiled_records_are_ignored(tmp_path):
    store = CheckpointStore(tmp_path)
    m, info = save(store, model_state(1), epoch=1)
    (ref,) = list((tmp_path / "refs").iterdir())
    good = CheckpointRecord.from_bytes(ref.read_bytes())

    # tampered: a later epoch with the old signature
    ref.write_bytes(CheckpointRecord(**{**good.__dict__, "epoch": 99}).to_bytes())
    assert store.list() == [] and store.latest("run") is None
    assert any("signature" in p for p in store.verify())
    with pytest.raises(CheckpointNotFound):
        store.resolve(info.cid)
    # misfiled: a valid record under another checkpoint's name
    ref.write_bytes(good.to_bytes())
    (tmp_path / "refs" / ("00" * 32 + ".0000000000000000")).write_bytes(good.to_bytes())
    (tmp_path / "refs" / "garbage").write_bytes(b"\x93not a record")
    assert [i.record for i in store.list()] == [good]
    assert len(store.invalid_records()) == 2
    result = store.gc()
    assert result.bad_refs_removed == 2 and [p.name for p in (tmp_path / "refs").iterdir()] == [ref.name]

    forged = CheckpointRecord(**{**good.__dict__, "size": good.size + 1})
    with pytest.raises(RecordError):
        store.commit(m, forged)
    with pytest.raises(RecordError):  # signed, but for another manifest
        store.commit(m, CheckpointRecord.sign(ME, run_id="run", epoch=1, manifest_id=bytes(32), size=m.total_size))


def test_commit_after_fetch_requires_every_chunk(tmp_path):
    src = CheckpointStore(tmp_path / "a")
    state = model_state(5)
    m, info = save(src, state, epoch=5)
    dst = CheckpointStore(tmp_path / "b")
    assert dst.missing_chunks(m) == list(range(m.num_chunks))
    for i in range(0, m.num_chunks, 2):
        dst.add_chunk(m, i, src.read_chunk(m, i))
    assert dst.missing_chunks(m) == list(range(1, m.num_chunks, 2))
    with pytest.raises(IncompleteCheckpointError):
        dst.commit(m, info.record)
    assert dst.list() == []
    with pytest.raises(IndexError):
        dst.add_chunk(m, m.num_chunks, b"")
    for i in dst.missing_chunks(m):
        dst.add_chunk(m, i, src.read_chunk(m, i))
    got = dst.commit(m, info.record)
    assert got.record == info.record and dst.latest("run").record == info.record
    assert same(restore(*dst.load(m.id)), state)
    assert list((tmp_path / "b" / "pending").iterdir()) == []


# ---------------------------------------------------------------------------------- resolve, pins, gc


def _colliding_states(prefix_len: int = 4) -> tuple[dict, dict]:
    """Two small states whose manifest ids share their first ``prefix_len`` hex digits."""
    seen: dict[str, int] = {}
    for i in range(20_000):
        h = build_snapshot({"x": torch.tensor([i])}, chunk_size=CHUNK)[0].id.hex()[:prefix_len]
        if h in seen:
            return {"x": torch.tensor([seen[h]])}, {"x": torch.tensor([i])}
        seen[h] = i
    raise AssertionError("no collision found")


def test_resolve_cids_hex_and_prefixes(tmp_path):
    store = CheckpointStore(tmp_path)
    a, b = _colliding_states()
    ma, ia = save(store, a, epoch=1)
    mb, ib = save(store, b, epoch=2)
    for text in (ia.cid, ma.id.hex(), ma.id.hex()[:12], ia.cid[:16], ia.cid.upper()):
        assert store.resolve(text) == ma.id
    with pytest.raises(AmbiguousCheckpointError, match="matches 2 checkpoints"):
        store.resolve(ma.id.hex()[:4])
    with pytest.raises(ValueError, match="too short"):
        store.resolve(ma.id.hex()[:2])
    with pytest.raises(CheckpointNotFound):
        store.resolve(cid(bytes(32)))
    unused = next(p for p in ("000000", "ffffff", "123456") if not any(m.hex().startswith(p) for m in (ma.id, mb.id)))
    with pytest.raises(CheckpointNotFound):
        store.resolve(unused)
    with pytest.raises(ValueError, match="not a checkpoint id"):
        store.resolve("not-a-cid")


def test_gc_keeps_newest_per_run_and_pinned(tmp_path):
    store = CheckpointStore(tmp_path)
    runs = {}
    for epoch in range(5):
        runs[("a", epoch)] = save(store, model_state(epoch), run="a", epoch=epoch)
    for epoch in range(2):
        runs[("b", epoch)] = save(store, model_state(10 + epoch), run="b", epoch=epoch)
    store.pin(runs[("a", 0)][0].id)
    result = store.gc(keep=2)
    kept = {(i.run_id, i.epoch) for i in result.kept}
    assert kept == {("a", 4), ("a", 3), ("a", 0), ("b", 1), ("b", 0)}
    assert {(i.run_id, i.epoch) for i in result.removed} == {("a", 1), ("a", 2)}
    assert {(i.run_id, i.epoch) for i in store.list()} == kept
    live = set().union(*(digests_of(runs[k][0]) for k in kept))
    assert set(blob_files(store)) == live and result.blobs_removed > 0
    for k in kept:
        assert same(restore(*store.load(runs[k][0].id)), model_state(k[1] if k[0] == "a" else 10 + k[1]))
    store.unpin(runs[("a", 0)][0].id)
    assert {(i.run_id, i.epoch) for i in store.gc(keep=1).kept} == {("a", 4), ("b", 1)}
    with pytest.raises(CheckpointNotFound):
        store.pin(runs[("a", 1)][0].id)


def test_gc_keeps_chunks_of_a_fetch_in_progress_until_it_goes_stale(tmp_path):
    src = CheckpointStore(tmp_path / "a")
    m, _ = save(src, model_state(1))
    dst = CheckpointStore(tmp_path / "b")
    dst.add_chunk(m, 0, src.read_chunk(m, 0))
    dst.add_chunk(m, 1, src.read_chunk(m, 1))
    dst.gc()
    assert dst.missing_chunks(m) == list(range(2, m.num_chunks))
    marker = tmp_path / "b" / "pending" / m.id.hex()
    old = marker.stat().st_mtime - 7200
    os.utime(marker, (old, old))  # the fetch stopped two hours ago
    result = dst.gc()
    assert result.pending_removed == 1 and result.blobs_removed == 2 and blob_files(dst) == {}


# ---------------------------------------------------------------------------------- crashes


CHILD = r"""
import itertools, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_ckpt_store import CHUNK, model_state
from dht import Identity
from p2ptrain.checkpoint import build_snapshot
from p2ptrain.checkpoint.store import CheckpointStore

root, mode, seeds = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
real_replace, renames = os.replace, itertools.count(1)  # next() is atomic: renames run in a thread pool

def replace(src, dst, *args, **kwargs):
    # stop before the rename that `mode` names, tell the parent, wait for it to kill us or say go
    if (mode == "chunk" and next(renames) == 4) or (mode == "record" and Path(dst).parent.name == "refs"):
        print("blocked", flush=True)
        sys.stdin.readline()
    return real_replace(src, dst, *args, **kwargs)

os.replace = replace
store = CheckpointStore(root)
for seed in seeds:
    m, buf = build_snapshot(model_state(seed), chunk_size=CHUNK)
    print(m.id.hex(), flush=True)
    store.save(m, buf, run_id="run", epoch=seed, identity=Identity())
print("saved", flush=True)
"""


def start_child(root: Path, mode: str, seeds: str) -> subprocess.Popen:
    code = CHILD.format(tests=str(Path(__file__).parent))
    return subprocess.Popen([sys.executable, "-c", code, str(root), mode, seeds], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["chunk", "record"])
def test_sigkill_during_save_leaves_previous_checkpoint_and_no_partial_one(tmp_path, mode, child_pids):
    before = child_pids()
    store = CheckpointStore(tmp_path)
    state_a = model_state(1)
    ma, ia = save(store, state_a, epoch=1)
    files_a = blob_files(store)

    child = start_child(tmp_path, mode, "2")
    try:
        partial = bytes.fromhex(child.stdout.readline().strip())
        assert child.stdout.readline().strip() == "blocked"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()

    fresh = CheckpointStore(tmp_path)
    assert [i.record for i in fresh.list()] == [ia.record] and fresh.latest("run").record == ia.record
    with pytest.raises(CheckpointNotFound):
        fresh.resolve(partial.hex())
    assert fresh.verify() == []
    assert same(restore(*fresh.load(ia.manifest_id)), state_a)
    # leftovers: the blobs renamed before the kill, and temp files (chunks are fsynced and
    # renamed by a pool while the next are written, so several may be in flight)
    leftovers = len(list((tmp_path / "tmp").iterdir()))
    assert len(blob_files(fresh)) > len(files_a) and leftovers >= 1
    if mode == "record":  # every blob was durable, only the record was missing: still invisible
        assert fresh.blobs.has(partial) and leftovers == 1

    result = fresh.gc()  # ...which gc removes, keeping the previous checkpoint whole
    assert result.removed == [] and result.temp_removed == leftovers
    assert blob_files(fresh) == files_a and list((tmp_path / "tmp").iterdir()) == []
    assert same(restore(*fresh.load(ia.manifest_id)), state_a)
    assert child_pids() <= before


@pytest.mark.timeout(120)
def test_gc_waits_for_a_save_in_progress(tmp_path, child_pids):
    fcntl = pytest.importorskip("fcntl")
    before = child_pids()
    store = CheckpointStore(tmp_path)
    save(store, model_state(1), epoch=1)
    child = start_child(tmp_path, "chunk", "2")
    gc_thread = None
    try:
        partial = bytes.fromhex(child.stdout.readline().strip())
        assert child.stdout.readline().strip() == "blocked"  # 3 chunks in, holding the writers' lock
        fd = os.open(tmp_path / "lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        results = []
        gc_thread = threading.Thread(target=lambda: results.append(store.gc(keep=5)))
        gc_thread.start()
        gc_thread.join(timeout=1.0)  # a bound, not a synchronisation: gc must still be waiting
        assert gc_thread.is_alive()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "saved"
        assert child.wait(timeout=30) == 0
        gc_thread.join(timeout=60)
        assert not gc_thread.is_alive() and results[0].blobs_removed == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()
    assert store.latest("run").manifest_id == partial
    assert same(restore(*store.load(partial)), model_state(2)) and store.verify() == []
    assert child_pids() <= before


@pytest.mark.timeout(120)
def test_two_processes_saving_at_once_corrupt_nothing(tmp_path, child_pids):
    before = child_pids()
    children = [start_child(tmp_path, "none", "1,2,3"), start_child(tmp_path, "none", "3,4,5")]
    try:
        outputs = [c.communicate(timeout=90)[0].split() for c in children]
        assert [c.returncode for c in children] == [0, 0]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    store = CheckpointStore(tmp_path)
    assert all(out[-1] == "saved" for out in outputs)
    assert sorted(i.epoch for i in store.list()) == [1, 2, 3, 3, 4, 5]  # epoch 3 by two writers
    assert store.verify() == []
    for info in store.list():
        assert same(restore(*store.load(info.manifest_id)), model_state(info.epoch))
    assert list((tmp_path / "tmp").iterdir()) == []
    assert child_pids() <= before


# ---------------------------------------------------------------------------------- durability order


def log_syscalls(monkeypatch) -> list[tuple]:
    """Record every fsync (start and end, by the real path its descriptor names) and rename
    (start and end), in order, from every thread: what a power cut could lose depends on it, and
    a SIGKILL test cannot see it (the page cache survives a killed process)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell which file an fsync flushes")
    log: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        path = os.path.realpath(f"/proc/self/fd/{fd}")
        log.append(("fsync<", path))
        real_fsync(fd)
        log.append(("fsync>", path))

    def replace(src, dst, *args, **kwargs):
        log.append(("rename<", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst, *args, **kwargs)
        log.append(("rename>", os.path.realpath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return log


def assert_durable_before_visible(log: list[tuple], blobs: list[Path], ref_dir: Path) -> None:
    """Each blob's bytes fsynced before it got its name; each blob's directory fsynced after
    the rename into it and before the record's rename; the record's directory fsynced after."""
    def first(pred, after: int = -1) -> int:
        return next((i for i, e in enumerate(log) if i > after and pred(e)), len(log))

    ref_dir = os.path.realpath(ref_dir)
    record = first(lambda e: e[0] == "rename<" and os.path.dirname(e[2]) == ref_dir)
    assert record < len(log), "the record was never renamed into refs/"
    for blob in map(os.path.realpath, blobs):
        renamed = first(lambda e: e[0] == "rename>" and e[1] == blob)
        if renamed == len(log):  # stored before this log started (dedupe); its directory still counts
            renamed = -1
        else:
            start = first(lambda e: e[0] == "rename<" and e[2] == blob)
            tmp = log[start][1]
            assert first(lambda e: e == ("fsync>", tmp)) < start, f"{blob} renamed before its bytes were fsynced"
        synced = first(lambda e: e == ("fsync<", os.path.dirname(blob)), after=renamed)
        done = first(lambda e: e == ("fsync>", os.path.dirname(blob)), after=synced)
        assert done < record, f"the directory of {blob} was not fsynced between its rename and the record's"
    assert first(lambda e: e == ("fsync<", ref_dir),
                 after=first(lambda e: e[0] == "rename>" and e[1].startswith(ref_dir))) < len(log)


def blob_paths(store: CheckpointStore, m: Manifest) -> list[Path]:
    return [store.blobs.path(m.chunk_digest(i)) for i in range(m.num_chunks)] + [store.blobs.path(m.id)]


def test_save_makes_every_blob_durable_before_the_record(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    save(store, model_state(1), epoch=1)
    log = log_syscalls(monkeypatch)
    m, _ = save(store, model_state(2), epoch=2)  # half its chunks are there already (the frozen tensor)
    assert_durable_before_visible(log, blob_paths(store, m), tmp_path / "refs")


def test_commit_makes_every_fetched_chunk_durable_before_the_record(tmp_path, monkeypatch):
    src = CheckpointStore(tmp_path / "a")
    m, info = save(src, model_state(3), epoch=3)
    dst = CheckpointStore(tmp_path / "b")
    log = log_syscalls(monkeypatch)
    for i in range(m.num_chunks):
        dst.add_chunk(m, i, src.read_chunk(m, i))
    dst.commit(m, info.record)
    assert_durable_before_visible(log, blob_paths(dst, m), tmp_path / "b" / "refs")


def test_a_failed_write_leaves_no_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    _, first = save(store, model_state(1), epoch=1)
    real_fsync, calls, lock = os.fsync, [], threading.Lock()

    def fsync(fd):  # the disk fills up at the third file
        with lock:
            calls.append(fd)
            n = len(calls)
        if n == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    m, buf = build_snapshot(model_state(2), chunk_size=CHUNK)
    with pytest.raises(OSError, match="No space left"):
        store.save(m, buf, run_id="run", epoch=2, identity=ME)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [i.record for i in store.list()] == [first.record] and list((tmp_path / "tmp").iterdir()) == []
    assert store.verify() == []
    store.save(m, buf, run_id="run", epoch=2, identity=ME)  # space again: the retry completes it
    assert store.latest("run").manifest_id == m.id and same(restore(*store.load(m.id)), model_state(2))


def test_repeated_chunks_are_written_once_and_progress_reaches_the_total(tmp_path):
    state = {"zeros": torch.zeros(8 * CHUNK // 4), "x": raw_tensor(torch.float32, (CHUNK // 4,), seed=3)}
    store = CheckpointStore(tmp_path)
    saved, loaded = [], []
    m, _ = save(store, state, progress=lambda done, total: saved.append((done, total)))
    assert m.num_chunks == 9 and len(blob_files(store)) == 3  # 8 equal zero chunks, 1 other, the manifest
    m2, buffer = store.load(m.id, progress=lambda done, total: loaded.append((done, total)))
    assert same(restore(m2, buffer), state)
    for seen, total in ((saved, m.total_size + len(m.to_bytes())), (loaded, m.total_size)):
        assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1] == (total, total)


def test_a_buffer_changed_after_build_snapshot_is_never_loaded(tmp_path):
    """save trusts the manifest's digests (build_snapshot just hashed the buffer): a caller
    that changes the buffer in between gets a checkpoint every read refuses, not wrong bytes."""
    store = CheckpointStore(tmp_path)
    m, buf = build_snapshot(model_state(1), chunk_size=CHUNK)
    buf[CHUNK + 5] ^= 1
    store.save(m, buf, run_id="run", epoch=1, identity=ME)
    with pytest.raises(CorruptBlobError, match="chunk 1 of"):
        CheckpointStore(tmp_path).load(m.id)
    problems = store.verify()
    assert len(problems) == 1 and "chunk 1" in problems[0]


# ---------------------------------------------------------------------------------- export


def test_export_writes_a_plain_safetensors_file(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = {"model": {"fc1.weight": torch.randn(20, 10), "fc1.bias": torch.zeros(20)},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(20, 10), "step": torch.tensor(2.0)}},
                           "param_groups": [{"lr": 0.1}]},
             "ids": [torch.arange(5), torch.empty(0, dtype=torch.int8)], "flag": torch.tensor([True, False]),
             "half": torch.randn(4).to(torch.bfloat16)}
    store = CheckpointStore(tmp_path / "store")
    m, info = save(store, state, epoch=7)
    out = tmp_path / "out.safetensors"
    store.export(m.id, out)
    loaded = load_file(out)
    want = {"model.fc1.weight": state["model"]["fc1.weight"], "model.fc1.bias": state["model"]["fc1.bias"],
            "optimizer.state.0.exp_avg": state["optimizer"]["state"][0]["exp_avg"],
            "optimizer.state.0.step": state["optimizer"]["state"][0]["step"],
            "ids.0": state["ids"][0], "ids.1": state["ids"][1], "flag": state["flag"], "half": state["half"]}
    assert sorted(loaded) == sorted(want) and all(same(loaded[k], want[k]) for k in want)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["p2ptrain.cid"] == info.cid and meta["p2ptrain.epoch"] == "7" and meta["p2ptrain.run_id"] == "run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "store"]  # no temp file left

    clash = {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    m2, _ = save(store, clash, epoch=8)
    with pytest.raises(ValueError, match="'a.b'"):
        store.export(m2.id, tmp_path / "clash.safetensors")
    assert not (tmp_path / "clash.safetensors").exists()
