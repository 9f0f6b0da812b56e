"""Harnesses for tests, benchmarks and the demo (not used by a training peer): child processes of
DHT nodes (``dht_swarm``) and averaging peers (``averaging_worker``), hostile peers (``hostile``),
churn schedules, a delay line, and test beds: several "hosts" on one Linux machine, joined by links
with real bandwidth limits.

Why: on loopback everything is CPU-bound, so anything built for slow links (compression, pipelining,
timeouts) cannot show. :class:`Testbed` puts each peer in a network namespace of its own, behind a
shaped link into a shared switch, so benchmarks and tests measure what a real network would do.
Needs root; :func:`available` says whether (and why not) before anything is created.
"""

from .netns import Host, Testbed, TestbedError, available, cleanup_stale, features

__all__ = ["Host", "Testbed", "TestbedError", "available", "cleanup_stale", "features"]
