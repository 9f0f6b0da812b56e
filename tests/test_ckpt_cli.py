"""`p2ptrain ckpt` driven as a user would: real subprocesses on a temporary data directory.

Covers the round trip file -> checkpoint -> file, listing and showing, the one-line errors (a
pickle file, an unknown or ambiguous id, a corrupt store) and `get` from a provider process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dht import Identity
from p2ptrain.checkpoint import build_snapshot
from p2ptrain.checkpoint.store import CheckpointStore

CLI = [sys.executable, "-m", "p2ptrain"]


def ckpt(*args: str, data: Path, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "ckpt", *args, "--data-dir", str(data)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_line_error(out: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2ptrain: error: "), out.stderr
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def model_file(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "fc1.weight": torch.randn(256, 300, generator=g), "fc1.bias": torch.randn(256, generator=g),
        "emb": torch.randn(50, 8, generator=g).to(torch.bfloat16), "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(3.5), "none": torch.empty(0, 4),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors


def quick_save(data: Path, tensors: dict, run: str, epoch: int) -> str:
    """What `ckpt save` stores for a file of ``tensors``, done in-process (a CLI start costs seconds)."""
    m, buffer = build_snapshot(tensors)
    return CheckpointStore(data).save(m, buffer, run_id=run, epoch=epoch, identity=Identity()).cid


def same_tensors(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def test_help_lists_every_action(tmp_path):
    out = subprocess.run([*CLI, "ckpt", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for action in ("save", "ls", "show", "get", "verify", "gc", "pin", "unpin", "export"):
        assert action in out.stdout
    out = subprocess.run([*CLI, "ckpt", "export", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--data-dir" in out.stdout and "safetensors" in out.stdout


def test_save_ls_show_export_round_trip(tmp_path):
    data = tmp_path / "store"
    tensors = model_file(tmp_path / "model.safetensors")
    saved = ckpt("save", str(tmp_path / "model.safetensors"), "--run-id", "r1", "--epoch", "3", data=data)
    assert saved.returncode == 0, saved.stderr
    cid = saved.stdout.strip()
    assert cid.startswith("bafkr4i") and "epoch 3" in saved.stderr

    listed = ckpt("ls", "--json", data=data)
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)
    assert entry["cid"] == cid and entry["run_id"] == "r1" and entry["epoch"] == 3 and not entry["pinned"]
    table = ckpt("ls", data=data)
    assert table.returncode == 0 and cid in table.stdout

    shown = ckpt("show", cid[:14], "--json", data=data)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["cid"] == cid and info["missing_chunks"] == [] and info["records"][0]["signature"] == "valid"
    assert {t["name"]: (t["dtype"], t["shape"]) for t in info["tensors"]} == {
        k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in tensors.items()}
    human = ckpt("show", cid, data=data)
    assert human.returncode == 0 and "fc1.weight" in human.stdout and "valid" in human.stdout

    out = tmp_path / "out.safetensors"
    exported = ckpt("export", cid, str(out), data=data)
    assert exported.returncode == 0, exported.stderr
    assert same_tensors(load_file(out), tensors)  # bit-exact, same names as the imported file

    verified = ckpt("verify", data=data)
    assert verified.returncode == 0 and "ok: 1 checkpoint" in verified.stdout


def test_pickle_files_are_refused(tmp_path):
    data = tmp_path / "store"
    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    one_line_error(ckpt("save", str(tmp_path / "model.pt"), "--run-id", "r", "--epoch", "0", data=data), 2,
                   "model.pt", "pickle")
    (tmp_path / "disguised.safetensors").write_bytes((tmp_path / "model.pt").read_bytes())
    one_line_error(ckpt("save", str(tmp_path / "disguised.safetensors"), "--run-id", "r", "--epoch", "0", data=data),
                   2, "pickle")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    one_line_error(ckpt("save", str(tmp_path / "junk.safetensors"), "--run-id", "r", "--epoch", "0", data=data),
                   2, "junk.safetensors", "not a valid safetensors file")
    one_line_error(ckpt("save", str(tmp_path / "missing.safetensors"), "--run-id", "r", "--epoch", "0", data=data),
                   2, "no such file")
    model_file(tmp_path / "m.safetensors")
    one_line_error(ckpt("save", str(tmp_path / "m.safetensors"), "--run-id", "a/b", "--epoch", "0", data=data),
                   2, "--run-id")
    assert CheckpointStore(data).list() == []


def _colliding_models(tmp_path: Path) -> tuple[Path, Path, str]:
    """Two model files whose checkpoint ids share their first four hex digits."""
    seen: dict[str, int] = {}
    for i in range(20_000):
        h = build_snapshot({"x": torch.tensor([i])})[0].id.hex()[:4]
        if h in seen:
            paths = []
            for j in (seen[h], i):
                save_file({"x": torch.tensor([j])}, tmp_path / f"m{j}.safetensors")
                paths.append(tmp_path / f"m{j}.safetensors")
            return paths[0], paths[1], h
        seen[h] = i
    raise AssertionError("no collision")


def test_unknown_ambiguous_and_malformed_ids(tmp_path):
    data = tmp_path / "store"
    a, b, prefix = _colliding_models(tmp_path)
    for epoch, path in enumerate((a, b)):
        quick_save(data, load_file(path), "r", epoch)
    one_line_error(ckpt("show", prefix, data=data), 2, "matches 2 checkpoints", "more characters")
    one_line_error(ckpt("export", "bafkr4i" + "a" * 52, str(tmp_path / "x.safetensors"), data=data), 1,
                   "no checkpoint")
    one_line_error(ckpt("pin", "nonsense!", data=data), 2, "not a checkpoint id")
    one_line_error(ckpt("verify", "ab", data=data), 2, "too short")
    unused = next(p for p in ("000000", "ffffff", "123456") if not prefix.startswith(p[:4]))
    one_line_error(ckpt("show", unused, data=data), 1, "no checkpoint matches")
    one_line_error(ckpt("get", "latest", "--run-id", "r", data=data), 2, "--bootstrap")
    assert not (tmp_path / "x.safetensors").exists()


def test_corrupt_store_is_reported_in_one_line_per_problem(tmp_path):
    data = tmp_path / "store"
    cid = quick_save(data, model_file(tmp_path / "model.safetensors"), "r", 1)
    store = CheckpointStore(data)
    m = store.manifest(store.resolve(cid))
    path = store.blobs.path(m.chunk_digest(0))
    blob = bytearray(path.read_bytes())
    blob[7] ^= 1
    path.write_bytes(bytes(blob))

    one_line_error(ckpt("export", cid, str(tmp_path / "out.safetensors"), data=data), 1, "chunk 0", "corrupt")
    assert not (tmp_path / "out.safetensors").exists()
    (data / "refs" / "junk").write_bytes(b"junk")
    verified = ckpt("verify", data=data)
    assert verified.returncode == 1 and "Traceback" not in verified.stderr
    problems = [line for line in verified.stderr.splitlines() if line.startswith("p2ptrain: error: ")]
    assert len(problems) == 2 and any("chunk 0" in p and "missing" in p for p in problems)
    assert any("junk" in p for p in problems)
    listed = ckpt("ls", data=data)  # still lists what is there, with a warning about the bad record
    assert listed.returncode == 0 and "1 record file" in listed.stderr


def test_gc_pin_and_unpin(tmp_path):
    data = tmp_path / "store"
    cids = []
    for epoch in range(3):
        cids.append(quick_save(data, model_file(tmp_path / "m.safetensors", seed=epoch), "r", epoch))
    assert ckpt("pin", cids[0], data=data).returncode == 0
    out = ckpt("gc", "--keep", "1", "--json", data=data)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [e["cid"] for e in result["removed"]] == [cids[1]] and result["blobs_removed"] > 0
    assert sorted(e["cid"] for e in json.loads(ckpt("ls", "--json", data=data).stdout)) == sorted([cids[0], cids[2]])
    assert ckpt("unpin", cids[0], data=data).returncode == 0
    assert "removed 1 checkpoint" in ckpt("gc", "--keep", "1", data=data).stdout
    one_line_error(ckpt("gc", "--keep", "-1", data=data), 2, "--keep")


def test_ls_lists_a_checkpoint_saved_by_two_peers_once_with_both_writers(tmp_path):
    """Two writers of one epoch save the same state: one checkpoint (one CID), two records."""
    data = tmp_path / "store"
    tensors = model_file(tmp_path / "m.safetensors")
    m, buffer = build_snapshot(tensors)
    store = CheckpointStore(data)
    a, b = Identity(), Identity()
    for who in (a, b):
        store.save(m, buffer, run_id="r", epoch=4, identity=who)
    other = quick_save(data, model_file(tmp_path / "n.safetensors", seed=1), "r", 2)
    listed = json.loads(ckpt("ls", "--json", data=data).stdout)
    assert [e["cid"] for e in listed] == [store.list()[0].cid, other]
    assert sorted(listed[0]["writers"]) == sorted([str(a.peer_id), str(b.peer_id)]) and listed[0]["epoch"] == 4
    assert len(listed[1]["writers"]) == 1
    table = ckpt("ls", data=data)
    assert table.returncode == 0 and "2 checkpoints in" in table.stdout, table.stdout
    assert a.peer_id.short() in table.stdout and b.peer_id.short() in table.stdout
    verified = ckpt("verify", data=data)
    assert "ok: 2 checkpoints" in verified.stdout  # the same count as ls

    empty = ckpt("ls", data=tmp_path / "empty")
    assert empty.returncode == 0 and "no checkpoints in" in empty.stderr and "--data-dir" in empty.stderr


STORE_READERS = """
import sys
from p2ptrain.cli import main
data, cid = sys.argv[1:3]
for action in (["ls"], ["show", cid], ["verify", cid], ["pin", cid], ["unpin", cid], ["gc", "--keep", "5"]):
    try:
        main(["ckpt", *action, "--data-dir", data])
    except SystemExit as e:
        assert not e.code, (action, e.code)
print("torch imported:", "torch" in sys.modules)
"""


def test_store_reading_commands_do_not_load_torch(tmp_path):
    """ls/show/verify/pin/unpin/gc read manifests and blobs only: they answer without importing
    torch (about 2 s of a 2.2 s `ckpt ls` before)."""
    data = tmp_path / "store"
    cid = quick_save(data, model_file(tmp_path / "m.safetensors"), "r", 1)
    out = subprocess.run([sys.executable, "-c", STORE_READERS, str(data), cid], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert cid[:12] in out.stdout and "torch imported: False" in out.stdout, out.stdout  # ls and show name it


def test_unwritable_data_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    one_line_error(ckpt("ls", data=blocker / "store"), 2, "checkpoint store")


PROVIDER = r"""
import asyncio, sys
from dht import DHTNode, Identity
from p2ptrain.checkpoint.store import CheckpointStore
from p2ptrain.checkpoint.swarm import CheckpointService, announce

async def main():
    # a bootstrap node and a provider: announcements need a peer to be stored on
    # the provider is the writer (its key signed the checkpoint): only writers announce "latest"
    boot, node = DHTNode(Identity(), ("127.0.0.1", 0)), DHTNode(Identity.load(sys.argv[2]), ("127.0.0.1", 0))
    await boot.start([])
    try:
        await node.start(boot.multiaddrs)
        store = CheckpointStore(sys.argv[1])
        async with CheckpointService(node, store):
            for info in store.list():
                await announce(node, store, info)
            print(boot.multiaddrs[0], flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # serve until the test closes our stdin
    finally:
        await node.close()
        await boot.close()

asyncio.run(main())
"""


@pytest.mark.timeout(120)
def test_get_fetches_the_latest_checkpoint_from_a_provider(tmp_path, child_pids):
    pytest.importorskip("p2ptrain.checkpoint.swarm")
    before = child_pids()
    provider_data, data = tmp_path / "provider", tmp_path / "mine"
    tensors = model_file(tmp_path / "model.safetensors")
    key = tmp_path / "writer.key"
    cid = ckpt("save", str(tmp_path / "model.safetensors"), "--run-id", "r", "--epoch", "4", "--key-file", str(key),
               data=provider_data).stdout.strip()
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    proc = subprocess.Popen([sys.executable, "-c", PROVIDER, str(provider_data), str(key)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = proc.stdout.readline().strip()
        assert addr.startswith("/ip4/127.0.0.1/tcp/"), proc.stderr.read() if not addr else addr
        writer = str(Identity.load(key).peer_id)  # the only writer: 'latest' believes it because we trust it
        got = ckpt("get", "latest", "--run-id", "r", "--bootstrap", addr, "--json", "--timeout", "60",
                   "--trusted-writers", writer, data=data)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["cid"] == cid
        by_cid = ckpt("get", cid, "--run-id", "r", "--bootstrap", addr, "--timeout", "60", data=data)
        assert by_cid.returncode == 0 and by_cid.stdout.strip() == cid  # already held: nothing to fetch
        missing = ckpt("get", "bafkr4i" + "a" * 52, "--run-id", "r", "--bootstrap", addr, "--timeout", "20",
                       data=data)
        one_line_error(missing, 1)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    out = tmp_path / "fetched.safetensors"
    assert ckpt("export", cid, str(out), data=data).returncode == 0
    assert same_tensors(load_file(out), tensors)
    assert ckpt("verify", data=data).returncode == 0
    assert child_pids() <= before
    assert os.path.exists(data / "refs")
