"""``dht.watchers``: who hears of a noticed write, how often, and the table's bounds (sans-IO)."""

from __future__ import annotations

from dht import Identity
from dht.watchers import MAX_WATCH, MIN_NOTICE_GAP, Watchers

A, B, C = (Identity().peer_id for _ in range(3))


def test_each_live_watcher_but_the_writer_hears_once_per_tag_and_not_too_often():
    w: Watchers[str] = Watchers()
    assert w.add(b"k", A, "a", 5.0, now=0.0) and w.add(b"k", B, "b", 5.0, now=0.0)
    assert w.due(b"other", 1, C, now=1.0) == []
    assert sorted(w.due(b"k", 1, B, now=1.0)) == ["a"]  # (B wrote it)
    assert w.due(b"k", 1, C, now=2.0) == ["b"]  # A heard of tag 1 already
    assert w.due(b"k", 2, C, now=2.0 + MIN_NOTICE_GAP / 2) == ["a"]  # B was told too recently
    assert w.due(b"k", 2, C, now=2.0 + MIN_NOTICE_GAP) == ["b"]
    assert w.due(b"k", 3, C, now=6.0) == [] and len(w) == 0  # both watches ran out


def test_a_watch_lasts_at_most_max_watch_unless_renewed_and_the_table_is_bounded():
    w: Watchers[str] = Watchers(max_keys=2, max_per_key=2)
    assert w.add(b"k", A, "a", 1e9, now=0.0)
    assert w.due(b"k", 1, None, now=MAX_WATCH - 1) == ["a"] and w.due(b"k", 2, None, now=MAX_WATCH + 1) == []
    assert w.add(b"k", A, "a", 10.0, now=100.0) and w.add(b"k", B, "b", 10.0, now=100.0)
    assert not w.add(b"k", C, "c", 10.0, now=101.0)  # full
    assert w.add(b"k", C, "c", 10.0, now=111.0)  # the others ran out: room again
    assert w.add(b"k2", A, "a", 10.0, now=111.0) and not w.add(b"k3", A, "a", 10.0, now=112.0)
    assert w.add(b"k3", A, "a", 10.0, now=130.0)  # the expired keys are pruned for it
    assert w.add(b"k3", A, "a2", 10.0, now=131.0) and w.due(b"k3", 1, None, now=132.0) == ["a2"]  # renewed
