"""``p2ptrain status``, ``--metrics-port``, ``--round-log`` and ``--key-file``, driven as a user would:
a bootstrap peer and two training peers as real processes, read from outside while they train.

One swarm serves every check (starting peers is what costs time on a small machine):

- peer A takes its options from a TOML file and a ``P2PTRAIN_*`` variable, serves metrics on a
  free port and logs its rounds; peer B keeps its identity in a key file;
- while both train: the metrics endpoint is scraped with urllib, and ``p2ptrain status`` prints
  the table and the JSON (both peers, their epochs), and the one-line errors for a run with no
  records (the default digits run, derived with --example) and an unreachable bootstrap peer;
- both leave; B restarts with the same key file and prints the same peer id, while ``status``
  shows A as "left"; A's round log is read back.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from dht import Identity, Multiaddr

CLI = [sys.executable, "-m", "p2ptrain"]
RUN = "status-test"

pytestmark = pytest.mark.timeout(150)


def status(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "status", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    return proc.returncode, out, err


def scrape(url: str) -> dict[str, float]:
    """The samples of a Prometheus text page, by name (labels dropped; info metrics keep theirs)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if not name.startswith("p2ptrain_info"):
                name = name.split("{", 1)[0] if "_bucket" not in name else name
            out[name] = float(value)
    return out


def test_status_metrics_round_log_and_key_file_with_a_running_swarm(tmp_path, child_pids, peer_process):
    before = child_pids()
    boot = subprocess.Popen([*CLI, "dht", "--listen", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    peers = []
    try:
        addr = boot.stdout.readline().strip()
        assert "/p2p/" in addr, addr
        (tmp_path / "a.toml").write_text(
            f'run_id = "{RUN}"\nepochs = 100000\nthreads = 1\ndata_seed = 1\nmetrics_port = 0\n'
            f'metrics_host = "127.0.0.1"\nround_log = "rounds.jsonl"\ncompute_delay = 5.0\nbootstrap = ["{addr}"]\n')
        a = peer_process("--config", "a.toml", name="a", cwd=tmp_path,
                         env={"P2PTRAIN_COMPUTE_DELAY": "0.02"})  # env > file
        common = ["--bootstrap", addr, "--run-id", RUN, "--epochs", "100000", "--threads", "1",
                  "--compute-delay", "0.02", "--key-file", "b.key"]
        b = peer_process(*common, "--data-seed", "2", name="b", cwd=tmp_path)
        peers += [a, b]
        started_a, started_b = a.wait_for("started"), b.wait_for("started")
        assert started_a["config"]["compute_delay"] == 0.02 and started_a["config"]["threads"] == 1
        url = started_a["metrics_url"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), url
        ids = {started_a["peer_id"], started_b["peer_id"]}
        assert started_b["peer_id"] == str(Identity.load(tmp_path / "b.key").peer_id)

        # metrics, scraped while A trains with B: wait for a few averaging rounds
        deadline = time.monotonic() + 40
        while True:
            m = scrape(url)
            if m.get("p2ptrain_rounds_total", 0) >= 3 and m.get("p2ptrain_group_size") == 2 \
                    and m.get("p2ptrain_local_samples_per_second", 0) > 0:  # a progress event came too
                break
            assert time.monotonic() < deadline, (m, a.errors(), b.errors())
            time.sleep(0.5)
        for name in ("p2ptrain_epoch", "p2ptrain_samples_total", "p2ptrain_swarm_peers", "p2ptrain_dht_peers",
                     "p2ptrain_bytes_sent_total", "p2ptrain_bytes_received_total", "p2ptrain_failed_rounds_total",
                     "p2ptrain_round_seconds_count", "p2ptrain_local_samples_per_second", "p2ptrain_training"):
            assert name in m, name
        assert m["p2ptrain_epoch"] >= 1 and m["p2ptrain_samples_total"] >= 512
        assert m["p2ptrain_bytes_sent_total"] > 10_000 and m["p2ptrain_bytes_received_total"] > 10_000
        assert m["p2ptrain_swarm_peers"] == 2 and m["p2ptrain_dht_peers"] >= 1  # (also right after a round)
        assert (m["p2ptrain_round_seconds_count"] >= 1
                and 0 < m["p2ptrain_round_seconds_sum"] < 60 * m["p2ptrain_round_seconds_count"])
        assert m["p2ptrain_failed_rounds_total"] <= m["p2ptrain_rounds_total"] and m["p2ptrain_training"] == 1
        assert any(f'peer_id="{started_a["peer_id"]}"' in k and f'run_id="{RUN}"' in k for k in m), m

        # status, from outside, four ways at once
        dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity().peer_id}"
        procs = [status("--bootstrap", addr, "--run-id", RUN, "--json"), status("--bootstrap", addr, "--run-id", RUN),
                 status("--bootstrap", addr, "--example", "digits"),
                 status("--bootstrap", dead, "--run-id", RUN, "--timeout", "2")]
        ((rc_json, out_json, _), (rc_table, table, _),
         (rc_none, _, err_none), (rc_dead, _, err_dead)) = map(finish, procs)
        assert rc_json == 0 and rc_table == 0
        doc = json.loads(out_json)
        assert doc["run_id"] == RUN and doc["key"] == f"{RUN}/progress"
        rows = {r["peer_id"]: r for r in doc["peers"]}
        assert set(rows) == ids
        progress_epochs = {p.latest["started"]["peer_id"]: p.latest.get("progress", {"epoch": 10**6})["epoch"]
                           for p in (a, b)}
        announced = {e["peer_id"]: e["multiaddrs"] for e in (started_a, started_b)}
        for peer_id, row in rows.items():
            assert isinstance(row["epoch"], int) and 1 <= row["epoch"] <= progress_epochs[peer_id] + 5, \
                (row, progress_epochs)
            first = Multiaddr.parse(announced[peer_id][0])  # the address its progress reports carry
            assert (row["left"] is False and row["address"] == f"{first.host}:{first.port}"
                    and 0 <= row["last_seen_s"] < 15)
            assert row["samples_per_second"] > 0
        assert doc["swarm"]["epoch"] == max(r["epoch"] for r in rows.values()) and doc["swarm"]["active"] == 2
        table_rows = {line.split()[1]: line for line in table.splitlines() if "…" in line}
        assert set(table_rows) == {"…" + i[-6:] for i in ids}, table
        for peer_id in ids:
            line, first = table_rows["…" + peer_id[-6:]], Multiaddr.parse(announced[peer_id][0])
            epoch = int(line.split("│")[2])
            assert 1 <= epoch <= max(progress_epochs.values()) + 5 and f"{first.host}:{first.port}" in line, line
        assert f"run {RUN}: 2 active peers" in table
        assert rc_none == 1 and len(err_none.strip().splitlines()) == 1
        # --example derives the run id as `p2ptrain peer` does: that run has no peers here
        assert re.search(r"no progress records under key 'digits-[0-9a-f]+/progress'", err_none), err_none
        assert "--run-id or --example must match" in err_none
        assert rc_dead == 1 and "could not reach any bootstrap peer" in err_dead

        # both leave; B comes back with its key file and keeps its peer id; status shows that A left
        assert a.stop() == 0 and b.stop() == 0, (a.errors(), b.errors())
        left = status("--bootstrap", addr, "--run-id", RUN, "--json")
        b2 = peer_process(*common, name="b2", cwd=tmp_path)
        peers.append(b2)
        assert b2.wait_for("started")["peer_id"] == started_b["peer_id"]
        assert b2.stop() == 0, b2.errors()
        rc_left, out_left, _ = finish(left)
        assert rc_left == 0
        assert {r["peer_id"]: r["left"] for r in json.loads(out_left)["peers"]}.get(started_a["peer_id"]) is True

        # the round log: one JSON line per round, every field of the right type
        lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert len(records) >= 3
        for r in records:
            assert r["peer_id"] == started_a["peer_id"] and r["run_id"] == RUN
            assert isinstance(r["epoch"], int) and isinstance(r["failures"], int) and isinstance(r["bytes_sent"], int)
            assert r["group_size"] is None or isinstance(r["group_size"], int)
            assert r["seconds"] is None or 0 <= r["seconds"] < 60
        ok = [r for r in records if r["group_size"] == 2]
        assert ok and all(r["bytes_sent"] > 0 and r["rounds"] >= 1 for r in ok)
        assert [r["epoch"] for r in records] == sorted(r["epoch"] for r in records)
    finally:
        for p in peers:
            p.kill()
        boot.kill()
        boot.wait()
    assert child_pids() <= before


def test_metrics_served_from_python_stay_on_loopback_by_default():
    """PeerMetrics.serve() bound every interface by default, where the CLI binds 127.0.0.1."""
    from p2ptrain.metrics import PeerMetrics

    m = PeerMetrics()
    m.serve(0)
    try:
        assert m._server.server_address[0] == "127.0.0.1"
    finally:
        m.close()


def test_metrics_and_round_log_in_process(tmp_path):
    """The same metrics without processes: fed events and round records, rendered and served."""
    from p2ptrain.metrics import PeerMetrics, RoundLog

    m = PeerMetrics()
    m.on_event({"event": "started", "peer_id": "12D3KooWtest", "run_id": "r", "epoch": 0,
                "config": {"task": "digits", "mode": "sync"}})
    record = {"event": "round", "epoch": 1, "rounds": 1, "group_size": 2, "seconds": 0.25, "bytes_sent": 1000,
              "bytes_received": 900, "failures": 0, "state_rounds": 0, "peers": 2, "samples": 512,
              "total_rounds": 1, "total_failures": 0}
    m.on_round(record)
    m.on_event({"event": "progress", "epoch": 1, "samples": 600, "loss": 0.5, "peers": 2, "bytes_sent": 1000,
                "bytes_received": 900, "rounds": 1, "failed_rounds": 0, "dht_peers": 3, "local_sps": 100.0,
                "receipts": 1, "receipt_samples": 512})
    m.on_round({**record, "epoch": 2, "group_size": None, "seconds": None, "rounds": 0, "failures": 1, "samples": 600,
                "bytes_sent": 0, "bytes_received": 0, "total_failures": 1})
    port = m.serve(0, "127.0.0.1")
    try:
        assert m.url == f"http://127.0.0.1:{port}/metrics"
        got = scrape(m.url)
    finally:
        m.close()
    assert got['p2ptrain_info{mode="sync",peer_id="12D3KooWtest",run_id="r",task="digits"}'] == 1
    assert got["p2ptrain_epoch"] == 2 and got["p2ptrain_samples_total"] == 600 and got["p2ptrain_dht_peers"] == 3
    assert got["p2ptrain_rounds_total"] == 1 and got["p2ptrain_failed_rounds_total"] == 1
    assert got["p2ptrain_bytes_sent_total"] == 1000 and got["p2ptrain_group_size"] == 2 and got["p2ptrain_loss"] == 0.5
    assert got["p2ptrain_round_seconds_count"] == 1 and got["p2ptrain_round_seconds_sum"] == 0.25
    assert got["p2ptrain_receipts_total"] == 1 and got["p2ptrain_receipt_samples_total"] == 512
    with pytest.raises(OSError):
        urllib.request.urlopen(m.url, timeout=2)  # closed with the peer: nothing serves the port any more

    log = RoundLog.open(tmp_path / "rounds.jsonl")
    log.write(record)
    log.write({**record, "epoch": 2})
    log.close()
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2] and "event" not in json.loads(lines[0])
