"""What a peer measures, for Prometheus (``--metrics-port``) and as a JSON-lines round log (``--round-log``).

Both are fed by :func:`p2ptrain.run.run_peer`'s hooks and nothing else: :meth:`PeerMetrics.on_event`
takes its ``started``/``progress``/``done`` events (the optimizer's stats, about once a second),
:meth:`PeerMetrics.on_round` and :meth:`RoundLog.write` its per-round records. A scrape reads the
latest values under a lock; it never touches the optimizer or the event loop.

The HTTP server is ``prometheus_client``'s own, on a registry of this peer's only (several peers in
one process do not mix), started by :meth:`PeerMetrics.serve` and stopped by :meth:`PeerMetrics.close`.
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Any

from dht import ConfigError

# name, type, help, event field
_FIELDS = [
    ("p2ptrain_epoch", "gauge", "Global epoch this peer is at (optimizer steps the swarm took together)", "epoch"),
    ("p2ptrain_epoch_samples", "gauge", "Samples this peer accumulated toward the current epoch", "local_samples"),
    ("p2ptrain_samples", "counter", "Samples this peer processed since it started", "samples"),
    ("p2ptrain_steps", "counter", "Local optimizer steps since this peer started", "steps"),
    ("p2ptrain_local_samples_per_second", "gauge", "This peer's training throughput", "local_sps"),
    ("p2ptrain_swarm_samples_per_second", "gauge", "Throughput of the peers training in the run (from their reports)",
     "swarm_sps"),
    ("p2ptrain_swarm_peers", "gauge", "Compatible peers training in the run (reported recently, at any epoch), "
     "this one included", "peers"),
    ("p2ptrain_dht_peers", "gauge", "Peers in this node's DHT routing table", "dht_peers"),
    ("p2ptrain_group_size", "gauge", "Size of the group of the last averaging round", "group_size"),
    ("p2ptrain_last_round_seconds", "gauge", "Duration of the last averaging round", "round_s"),
    ("p2ptrain_rounds", "counter", "Averaging rounds this peer took part in", "rounds"),
    ("p2ptrain_failed_rounds", "counter", "Averaging rounds that found nobody, failed or lost part of the average",
     "failed_rounds"),
    ("p2ptrain_state_rounds", "counter", "Rounds that averaged the parameters and optimizer state", "state_rounds"),
    ("p2ptrain_state_loads", "counter", "Times this peer downloaded the swarm's state", "state_loads"),
    ("p2ptrain_bytes_sent", "counter", "Bytes this peer sent in averaging rounds", "bytes_sent"),
    ("p2ptrain_bytes_received", "counter", "Bytes this peer received in averaging rounds", "bytes_received"),
    ("p2ptrain_receipts", "counter", "Averaging rounds this peer signed a contribution receipt for", "receipts"),
    ("p2ptrain_receipt_samples", "counter", "Samples this peer's own receipts credit it with", "receipt_samples"),
    ("p2ptrain_loss", "gauge", "Training loss (moving average of the local batches)", "loss"),
]
_ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _need_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("--metrics-port needs the prometheus-client package: pip install prometheus-client") from None
    return prometheus_client


class PeerMetrics:
    """The Prometheus metrics of one training peer (names in ``_FIELDS``, plus
    ``p2ptrain_round_seconds`` (histogram), ``p2ptrain_info`` and ``p2ptrain_training``)."""

    def __init__(self) -> None:
        prom = _need_prometheus()
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self._families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._info: dict[str, str] = {}
        self._training = 0.0
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        self.round_seconds = prom.Histogram("p2ptrain_round_seconds", "Duration of averaging rounds (matchmaking "
                                            "and all-reduce)", buckets=_ROUND_BUCKETS, registry=self.registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # ------------------------------------------------------------------ fed by run_peer's hooks

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        with self._lock:
            if kind == "started":
                config = event.get("config") or {}
                self._info = {"peer_id": str(event.get("peer_id", "")), "run_id": str(event.get("run_id", "")),
                              "task": str(config.get("task", "")), "mode": str(config.get("mode", ""))}
                self._values["epoch"] = float(event.get("epoch", 0))
                self._training = 1.0
            elif kind in ("progress", "done"):
                for *_, key in _FIELDS:
                    value = event.get(key)
                    if isinstance(value, (int, float)):
                        self._values[key] = float(value)
                    elif key == "loss":
                        self._values.pop(key, None)
                self._training = 0.0 if kind == "done" else 1.0

    def on_round(self, record: dict[str, Any]) -> None:
        """A round record (see ``p2ptrain.run._round_record``): counters move at once, not only at
        the next progress event."""
        if record.get("rounds") and isinstance(record.get("seconds"), (int, float)):
            self.round_seconds.observe(record["seconds"])
        with self._lock:
            v = self._values
            if record.get("group_size") is not None:
                v["group_size"] = float(record["group_size"])
                v["round_s"] = float(record["seconds"] or 0.0)
            for key, field in (("rounds", "total_rounds"), ("failed_rounds", "total_failures"), ("epoch", "epoch"),
                               ("peers", "peers"), ("samples", "samples")):
                if isinstance(record.get(field), int):
                    v[key] = float(record[field])
            for key in ("bytes_sent", "bytes_received", "state_rounds"):  # deltas; progress events carry the totals
                if isinstance(record.get(key), int):
                    v[key] = v.get(key, 0.0) + record[key]

    # ------------------------------------------------------------------ prometheus_client's collector protocol

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        with self._lock:
            values, info, training = dict(self._values), dict(self._info), self._training
        if info:
            yield InfoMetricFamily("p2ptrain", "This peer: its id, run, task and mode", value=info)
        yield GaugeMetricFamily("p2ptrain_training", "1 while this peer trains, 0 before it starts and once done",
                                value=training)
        for name, kind, help_text, key in _FIELDS:
            family = self._families[kind]
            value = values.get(key, math.nan if key == "loss" else 0.0)
            yield family(name, help_text, value=value)

    def describe(self) -> Any:
        return []  # the metrics are only known at collection (keeps auto_describe from collecting early)

    def render(self) -> bytes:
        """The metrics in the Prometheus text format (what a scrape gets)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    # ------------------------------------------------------------------ the HTTP server

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) in prometheus_client's server
        thread until :meth:`close`; returns the port. OSError when the port is taken. Loopback
        by default, as ``--metrics-host``: the metrics name peers and addresses."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_port
        shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        self.url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{bound}/metrics"
        return bound

    def close(self) -> None:
        """Stop the HTTP server and wait for its thread (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)


class RoundLog:
    """Appends ``run_peer``'s round records to a file, one JSON object per line, flushed at once
    (another process may ``tail -f`` it; several peers may append to the same file)."""

    def __init__(self, file: Any, path: str):
        self._file = file
        self.path = path
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RoundLog:
        try:
            return cls(open(path, "a", encoding="utf-8"), str(path))
        except OSError as e:
            raise ConfigError(f"--round-log {path}: cannot open it for appending: {e.strerror or e}") from None

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: v for k, v in record.items() if k != "event"}, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)  # one write per line: O_APPEND keeps lines of several peers whole
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


# name, type, help, Row attribute: the leaderboard's figures (p2ptrain.contrib.leaderboard.Row)
_LEADERBOARD = [
    ("p2ptrain_contribution_rounds", "counter", "Rounds a majority of the peer's group signed receipts for", "rounds"),
    ("p2ptrain_contribution_samples", "counter", "Samples the peer's groups credited it with", "samples"),
    ("p2ptrain_contribution_exclusions", "counter", "Of those rounds, those the peer was excluded from", "exclusions"),
    ("p2ptrain_contribution_compute_seconds", "counter", "Compute time the peer claims for its rounds", "compute_s"),
    ("p2ptrain_contribution_bytes_sent", "counter", "Bytes the peer claims it sent in its rounds", "bytes_sent"),
    ("p2ptrain_contribution_first_seen", "gauge", "Unix time of the peer's first confirmed round", "first_seen"),
    ("p2ptrain_contribution_last_seen", "gauge", "Unix time of the peer's last confirmed round", "last_seen"),
]


class LeaderboardCollector:
    """A run's leaderboard (``p2ptrain status --leaderboard``) as Prometheus metrics, one series per
    peer (labels ``run_id``, ``peer_id``, ``name``)."""

    def __init__(self, run_id: str, rows: list[Any]):
        self.run_id, self.rows = run_id, rows

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        labels = ["run_id", "peer_id", "name"]
        for name, kind, help_text, attr in _LEADERBOARD:
            family = kinds[kind](name, help_text, labels=labels)
            for row in self.rows:
                value = getattr(row, attr)
                if value is not None:
                    family.add_metric([self.run_id, str(row.peer), row.name or ""], float(value))
            yield family
        why = CounterMetricFamily("p2ptrain_contribution_exclusion_reasons", "Exclusions of the peer by reason",
                                  labels=[*labels, "reason"])
        for row in self.rows:
            for reason, count in sorted(row.reasons.items()):
                why.add_metric([self.run_id, str(row.peer), row.name or "", reason], float(count))
        yield why

    def describe(self) -> Any:
        return []

    def render(self) -> bytes:
        """The leaderboard in the Prometheus text format."""
        prom = _need_prometheus()
        registry = prom.CollectorRegistry(auto_describe=True)
        registry.register(self)
        return prom.generate_latest(registry)
