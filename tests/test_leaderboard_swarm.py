"""The leaderboard of a real swarm (issue 32): four ``p2ptrain peer`` processes train a few epochs,
publishing their signed receipts; once they left, ``p2ptrain status --leaderboard`` reads them from
a DHT node that stayed, and agrees with what each peer counted itself. Bounded: every process is
killed at the end whatever happened."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import pytest

from p2ptrain.cli import main
from p2ptrain.contrib import leaderboard, read_file, read_receipts

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

EPOCHS = 8


def test_the_leaderboard_agrees_with_the_peers_own_counts(peer_process, dhts, tmp_path, capsys):
    dht = dhts()  # stays after the peers leave: their receipts live on in its store
    boot = str(dht.multiaddrs[0])
    swarm = [peer_process("--threads", "1", "--bootstrap", boot, "--wait-peers", "4", "--epochs", str(EPOCHS),
                          "--data-seed", str(i), "--name", f"peer {i}", "--receipts-file", str(tmp_path / f"{i}.jsonl"))
             for i in range(4)]
    done = [p.done(timeout=150) for p in swarm]
    started = [p.latest["started"] for p in swarm]
    run_id = started[0]["run_id"]
    signed, names = dht.run(read_receipts(dht.node, run_id), timeout=20)
    rows = {str(r.peer): r for r in leaderboard(signed, names)}
    assert sorted(names.values()) == [f"peer {i}" for i in range(4)]
    for s, d in zip(started, done):
        row = rows[s["peer_id"]]
        assert d["receipts"] >= EPOCHS // 2, d  # most epochs averaged in a group
        assert (row.rounds, row.samples, row.exclusions) == (d["receipts"], d["receipt_samples"], 0), (row, d)
        assert 0 < row.samples <= d["samples"] and row.rounds <= d["rounds"]
        assert 0 < row.bytes_sent <= d["bytes_sent"] and row.compute_s > 0
        assert row.first_seen is not None and row.first_seen <= row.last_seen
    out = subprocess.run([sys.executable, "-m", "p2ptrain", "status", "--leaderboard", "--json", "--bootstrap", boot,
                          "--run-id", run_id], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = {p["peer_id"]: p for p in json.loads(out.stdout)["peers"]}
    assert {k: (v["rounds"], v["samples"], v["name"]) for k, v in shown.items()} == {
        k: (r.rounds, r.samples, r.name) for k, r in rows.items()}
    flags = ["status", "--leaderboard", "--bootstrap", boot, "--run-id", run_id]
    capsys.readouterr()
    assert main([*flags, "--csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert {r["peer_id"]: int(r["samples"]) for r in table} == {k: r.samples for k, r in rows.items()}
    assert main([*flags, "--prometheus"]) == 0
    text = capsys.readouterr().out
    for k, r in rows.items():
        assert f'p2ptrain_contribution_samples_total{{name="{r.name}",peer_id="{k}",run_id="{run_id}"}} ' \
               f"{float(r.samples)}" in text
    assert main([*flags, "--csv", "--json"]) == 2 and "give one of" in capsys.readouterr().err
    # each peer's file holds its own receipts, signed
    assert [len(read_file(tmp_path / f"{i}.jsonl")) for i in range(4)] == [d["receipts"] for d in done]
