"""Global training progress through the DHT: who trains, at which epoch, how fast, how far along.

There is no master to count samples, so every peer publishes a small owner-signed record under
``{run_id}/progress`` (one sub-key per peer) and reads everyone else's. From those records each peer
computes the same :class:`SwarmView` on its own: the swarm's epoch, the samples accumulated toward
it, how many peers are at that epoch and which of them are ready to average. The samples come twice:
as *reported* (what the peers published: an epoch ends on this count, so it never has fewer samples
than the target) and *estimated* (extrapolated to now with each peer's measured throughput: it only
says when to look again, and the tracker reads the DHT fast while the estimate is past the target
and the reports are not yet).

``summarize`` is the sans-IO core (plain records in, a view out); :class:`ProgressTracker` is the
asyncio shell that publishes and polls, refreshing faster as the end of an epoch approaches.
Records of peers with another model (schema hash) are kept apart: they never count, and each such
peer is reported once, with what to do about it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from dht import Contact, DHTError, DHTNode, InvalidRecord, OwnedRead, PeerID, wait_event

from ..addresses import Reach
from ..averaging.schema import shards_mismatch_message, shards_of
from .report import PeerReport, parse_report

log = logging.getLogger("p2ptrain.progress")

_SUBKEY = "p"
_MAX_RECORD = 2048
_MAX_EXTRAPOLATION = 5.0  # s: never extrapolate a report further than this (clock skew, stalls)
_WATCH = 6.0  # s: a holder read tells us of ready reports this long (reads rotate over 3 holders)
_NOTICE_GAP = 0.25  # s: at most one read per this on notices
_LOCAL_GAP = 0.02  # s: at most one merge of the reports a notice handed over per this
_DUE_READS_PER_S = 250.0  # reads of the key a second, by the whole swarm, while an epoch looks over
_MAX_DUE_GAP = 0.25  # s: but each peer reads at least this often then


async def read_reports(node: DHTNode, key: str, holders: list[Contact] | None = None,
                       watch: float = 0.0) -> tuple[list[PeerReport], OwnedRead]:
    """The well-formed reports under ``key`` (``{run_id}/progress``), each from its owner's own
    sub-key (nobody can speak for another peer), and the read that found them: a lookup of the
    key, or one RPC to each of ``holders`` (which then tell us of ready reports for ``watch`` s)."""
    read = await node.get_owned(key, _SUBKEY, max_size=_MAX_RECORD, holders=holders or None, watch=watch)
    reports = (parse_report(entry.value, peer) for peer, entry in read.values.items())
    return [r for r in reports if r is not None], read


@dataclass(frozen=True)
class SwarmView:
    """What the swarm looks like from one peer at one moment."""

    epoch: int  # the most advanced epoch among compatible peers (ours included)
    samples: float  # samples toward finishing ``epoch``, extrapolated to ``now`` (an estimate)
    target: int
    peers: list[PeerReport] = field(default_factory=list)  # compatible peers at ``epoch``, us included
    behind: list[PeerReport] = field(default_factory=list)  # compatible peers at an older epoch
    sps: float = 0.0  # swarm throughput (peers at ``epoch``)
    now: float = 0.0
    reported: int = 0  # samples toward ``epoch`` as the peers published them (ours as of now)

    @property
    def num_peers(self) -> int:
        return len(self.peers)

    @property
    def training(self) -> list[PeerReport]:
        """Every compatible peer that reported recently, at any epoch, us included: the peers
        training in the run (right after a round the others may still report the epoch before)."""
        return [*self.peers, *self.behind]

    @property
    def ready(self) -> list[PeerReport]:
        return [p for p in self.peers if p.ready]

    @property
    def eta(self) -> float:
        """Seconds until the target is reached at the current throughput (inf when nobody computes)."""
        missing = self.target - self.samples
        if missing <= 0:
            return 0.0
        return missing / self.sps if self.sps > 0 else math.inf

    @property
    def reached(self) -> bool:
        """The peers' published counts add up to the target: the epoch is over."""
        return self.reported >= self.target

    @property
    def due(self) -> bool:
        """The estimate says the target is reached: time to read the peers' counts again."""
        return self.samples >= self.target


def latest_reports(reports: Iterable[PeerReport], me: PeerReport, ignored: Iterable[PeerID] = ()) -> list[PeerReport]:
    """Each other peer's newest report with our schema that is not a goodbye: the part of
    :func:`summarize` that hashes PeerIDs (a Python call each), which a tracker does once per read."""
    latest: dict[PeerID, PeerReport] = {}
    skip = {me.peer, *ignored}
    for r in reports:
        if r.left or r.schema != me.schema or r.peer in skip:
            continue
        seen = latest.setdefault(r.peer, r)
        if seen is not r and (r.epoch, r.time) > (seen.epoch, seen.time):
            latest[r.peer] = r
    return list(latest.values())


def summarize(reports: Iterable[PeerReport], me: PeerReport, now: float, target: int,
              stale_after: float, ignored: Iterable[PeerID] = (), epoch_started: float | None = None) -> SwarmView:
    """The swarm as seen from ``me`` (whose own report is always fresh).

    Reports older than ``stale_after`` seconds and reports with another schema are ignored.
    ``reported`` sums the counts as published. The estimate ``samples`` extrapolates each peer's
    count by its throughput since its report (at most a few seconds, so a dead peer stops counting
    quickly and clock skew cannot run away); a peer that is ``ready`` has stopped computing and is
    not extrapolated.
    """
    oldest = now - stale_after
    latest = latest_reports((r for r in reports if r.time >= oldest), me, ignored)
    return tally(latest, me, now, target, stale_after, epoch_started)


def tally(latest: list[PeerReport], me: PeerReport, now: float, target: int, stale_after: float,
          epoch_started: float | None = None) -> SwarmView:
    """:func:`summarize` of reports already through :func:`latest_reports` (the per-step part:
    no hashing, one pass of arithmetic per peer)."""
    oldest = now - stale_after
    fresh = [r for r in latest if r.time >= oldest]
    everyone = [me, *fresh]
    epoch = max(r.epoch for r in everyone)
    at_epoch = [r for r in everyone if r.epoch == epoch]
    reported = sum(r.samples for r in at_epoch)
    samples = float(reported)
    for r in at_epoch:
        if not r.ready and r is not me:
            samples += r.sps * min(max(0.0, now - r.time), _MAX_EXTRAPOLATION)
    if epoch_started is not None and me.epoch == epoch:
        # Peers still reporting the previous epoch (even as ready: that is how they entered its
        # round) have most likely finished it with us and compute for this one, unpublished yet:
        # count their throughput since our epoch began, or short epochs overshoot several times.
        for r in fresh:
            if r.epoch == epoch - 1:
                samples += r.sps * min(max(0.0, now - max(epoch_started, r.time)), _MAX_EXTRAPOLATION)
    return SwarmView(
        epoch=epoch, samples=samples, target=target, peers=at_epoch,
        behind=[r for r in everyone if r.epoch < epoch], sps=sum(r.sps for r in at_epoch), now=now,
        reported=reported,
    )


def _more_than_count(new: PeerReport, old: PeerReport) -> bool:
    """Whether ``new`` differs from ``old`` in more than its count and throughput (an epoch, the
    ready flag, an address): news that others wait on."""
    return replace(new, samples=old.samples, sps=old.sps, time=old.time, eta=old.eta) != old


def refresh_period(view: SwarmView, ready: bool, refresh: float, min_refresh: float, slow_refresh: float) -> float:
    """Seconds to the next refresh: ``slow_refresh`` while we wait in a round (what we read changes
    nothing until it ends, and our next epoch's report goes out at once); fast once the estimate or a
    peer says the epoch is over; else when the estimate reaches the target (others publish their
    counts then). Far from it, at half the time left, at most ``slow_refresh``: each read returns
    every peer's record, and the estimate is good for that long."""
    if ready:
        return max(slow_refresh, refresh)
    if view.reached or view.ready:
        return min_refresh * 2
    if view.due:
        return min_refresh
    if view.sps <= 0:
        return refresh
    if view.eta > 2 * refresh:
        return min(view.eta / 2, max(slow_refresh, refresh))
    return min(refresh, max(min_refresh, view.eta))


class ProgressTracker:
    """Publishes this peer's progress and keeps a fresh :class:`SwarmView` of everyone's.

    Lives on the DHT's event loop; the training thread calls :meth:`report` (thread-safe, never
    blocks) and reads :attr:`view`. The refresh period shrinks as the epoch's end approaches
    (see :func:`refresh_period`); once the estimate is past the target,
    :meth:`hurry` (called at each step) gets a refresh at once, at most one per ``fast_refresh``
    (longer in a large swarm: ``_due_gap``), until the published counts reach it.

    A refresh publishes to the ``holders`` peers nearest the key that answered a full lookup (one at
    most ``relookup`` seconds ago, or an earlier one: a loaded holder may miss a lookup, and one
    that fails a read is dropped), and reads from one of them in turn (each holds every report;
    reports are kept across reads, each peer's newest): its cost does not grow with the swarm beyond
    the records themselves. A full lookup is redone sooner when the holder asked fails. A read asks
    its holder to tell us (``dht.watchers``) when a peer publishes its first ready report of an
    epoch: the peers waiting for the epoch's end read it then, not at their next poll. Our report
    goes out in a task of its own, so a read never waits for the slowest holder to take it.

    Every reader checks the signature of every record that changed since its last read, so a report
    is republished only when others need it (see :meth:`_publish_due`): a new sample count goes out
    every ``publish_every`` seconds (readers extrapolate in between), or at once near the epoch's end.
    """

    def __init__(self, node: DHTNode, run_id: str, schema: str, target: int, *, refresh: float = 0.5,
                 min_refresh: float = 0.05, fast_refresh: float = 0.01, ttl: float | None = None,
                 on_mismatch: Callable[[PeerID, str], None] | None = None,
                 judge: Callable[[list[PeerReport], PeerReport], dict[PeerID, str]] | None = None,
                 on_refused: Callable[[dict[PeerID, str]], None] | None = None,
                 held: Callable[[], int] | None = None, holders: int = 3, relookup: float = 15.0,
                 publish_every: float = 2.0, slow_refresh: float = 2.0):
        if target < 1:
            raise ValueError("target_batch_size must be at least 1")
        self.node = node
        self.key = f"{run_id}/progress"
        self.schema = schema
        self.target = target
        self.refresh = refresh
        self.min_refresh = min_refresh
        self.slow_refresh = slow_refresh
        self.fast_refresh = fast_refresh
        self.ttl = ttl if ttl is not None else max(10.0, 6 * refresh)
        self.publish_every = publish_every
        self._on_mismatch = on_mismatch
        #: verdicts on epoch claims (see ``claims``): the peers it refuses stay out of the view
        self._judge = judge
        self._on_refused = on_refused
        self._held = held  # the updates our state holds, published with each report
        reach = Reach.of_node(node)
        self._me = PeerReport(node.peer_id, 0, 0, 0.0, time.time(), schema, reach.addr, False, node.client_mode,
                              relays=reach.relays)
        self._published: PeerReport | None = None
        self._published_at = 0.0  # the time in the report we last published
        self._hidden = False  # reading only (see start)
        self._reports: list[PeerReport] = []
        #: latest_reports of (_reports, the peers ignored then), reused until either changes
        self._latest: tuple[list[PeerReport], list[PeerID], list[PeerReport]] = (self._reports, [], [])
        #: each peer's newest report read, and when a read last returned it (monotonic)
        self._known: dict[PeerID, tuple[PeerReport, float]] = {}
        self.view = summarize([], self._me, time.time(), target, self.ttl)
        self.mismatched: dict[PeerID, str] = {}
        self._epoch_started: float | None = None  # when our current epoch began (wall clock)
        self._ignored: dict[PeerID, float] = {}  # peer -> monotonic time until which it is left out
        self._wake = asyncio.Event()
        self._hurried = False  # a hurry() wake-up is pending (one per refresh, however many steps ask)
        self._asked = False  # a wait_fresh() wake-up is pending
        self._last_refresh = 0.0  # loop time the last refresh began
        self._closest: list[Contact] = []  # the key's closest peers, as the last full lookup found them
        self.holders = holders
        self._turn = 0  # which of them the next read asks
        self.relookup = relookup
        self._looked_up_at = -math.inf  # monotonic time of the last full lookup of the key
        self._lookups = 0  # full lookups done (the first few come sooner: see _refresh)
        self._fresh = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._notices: asyncio.Task | None = None  # _hear_notices
        self._publishing: asyncio.Future | None = None  # our report on its way to the holders
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- lifecycle (on the loop)

    async def start(self, publish: bool = True) -> None:
        """Publish our first report and read the swarm once, then keep both fresh. With
        ``publish=False`` only read until :meth:`publish`: a peer still choosing its starting
        state (a checkpoint, the swarm's) must not be seen, and counted, at an epoch it leaves."""
        self._loop = asyncio.get_running_loop()
        self._hidden = not publish
        await self._refresh()
        self._task = self._loop.create_task(self._run())
        self._notices = self._loop.create_task(self._hear_notices())

    async def close(self, goodbye_timeout: float = 2.0) -> None:
        """Stop refreshing and tell the swarm we left (best effort, bounded), so that nobody
        counts on us, or takes our epoch for the swarm's, until our record expires."""
        if self._task is not None:
            tasks = [t for t in (self._task, self._notices, self._publishing) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._task = self._notices = self._publishing = None
            if self._published is None:  # never seen: nothing to take back
                return
            self._me = replace(self._me, left=True, time=time.time())
            try:
                async with asyncio.timeout(goodbye_timeout):
                    await self.node.store_owned(self.key, _SUBKEY, self._me.to_wire(), time.time() + self.ttl)
            except (TimeoutError, DHTError, InvalidRecord, OSError) as e:
                log.debug("could not say goodbye: %s", e)

    def ignore(self, peers: Iterable[PeerID], seconds: float | None = None) -> None:
        """Leave ``peers`` out of the view for a while (e.g. they claim an epoch whose state they
        do not serve); any thread."""
        until = time.monotonic() + (self.ttl if seconds is None else seconds)
        for peer in peers:
            self._ignored[peer] = until
        self.view = self.estimate()

    def _ignored_now(self) -> list[PeerID]:
        now = time.monotonic()
        return [p for p, until in list(self._ignored.items()) if until > now]

    # ---------------------------------------------------------------- training thread side

    @property
    def me(self) -> PeerReport:
        return self._me

    def report(self, epoch: int, samples: int, sps: float, ready: bool = False, eta: float | None = None) -> SwarmView:
        """Update our progress (any thread; ``eta``: see :class:`PeerReport`) and return the view
        with it, extrapolated to now. Publishing happens on the next refresh, at once when the
        epoch or the ready flag changed: other peers wait on those."""
        old = self._me
        if epoch != old.epoch:
            self._epoch_started = time.time()
        self._me = replace(old, epoch=epoch, samples=samples, sps=sps, ready=ready, time=time.time(),
                           held=None if self._held is None else self._held(), eta=eta)
        self.view = view = self.estimate()
        if (epoch, ready) != (old.epoch, old.ready) and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._publish_news)
        return view

    def _publish_news(self) -> None:
        """Our epoch or ready flag changed: publish it now, not after the read in flight (under load
        that is a round trip or more, and peers wait on it), and read soon after."""
        self._wake.set()
        if self._task is not None:
            self._publish_current()

    def _publish_current(self) -> None:
        """Store our report as it is now, unless hidden; a store in flight sends it once it is in
        (see :meth:`_publish`)."""
        if not self._hidden and self._publishing is None:
            self._publishing = asyncio.ensure_future(self._publish(self._me, time.time(), False))

    def hurry(self) -> None:
        """Refresh as soon as ``fast_refresh`` allows (any thread; cheap when one is pending):
        the estimate says the epoch is over and only a fresh read of the counts can confirm it."""
        if self._hurried or self._loop is None or self._loop.is_closed():
            return
        self._hurried = True
        self._loop.call_soon_threadsafe(self._wake.set)

    def estimate(self) -> SwarmView:
        """The view extrapolated to now, from the last reports read (no DHT traffic)."""
        ignored, cached = self._ignored_now(), self._latest
        if cached[0] is not self._reports or cached[1] != ignored:  # (one tuple: another thread may swap it)
            cached = self._latest = (self._reports, ignored, latest_reports(self._reports, self._me, ignored))
        return tally(cached[2], self._me, time.time(), self.target, self.ttl, self._epoch_started)

    # ---------------------------------------------------------------- loop side

    async def refresh_now(self, timeout: float | None = None) -> SwarmView:
        """Publish and read right now (e.g. before deciding to download state). ``timeout``: at
        most that many seconds, after which the view is the one read last."""
        try:
            async with asyncio.timeout(timeout):
                await self._refresh()
        except TimeoutError:
            log.debug("progress refresh took longer than %.1f s; using the last view", timeout)
        return self.view

    async def publish(self, timeout: float | None = None) -> SwarmView:
        """After ``start(publish=False)``: publish our report from now on, at once (as
        :meth:`refresh_now`)."""
        self._hidden = False
        return await self.refresh_now(timeout)

    async def wait_fresh(self, timeout: float) -> SwarmView:
        """Wait for the next completed refresh (at most ``timeout``), then return the view. One
        starts at once, but at most one per ``min_refresh`` for these: a caller that loops on this
        (``wait_for_peers``, ``drain``) must not read the key's holders back to back."""
        self._fresh.clear()
        self._asked = True
        self._wake.set()
        await wait_event(self._fresh, timeout)
        return self.view

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            period = refresh_period(self.view, self._me.ready, self.refresh, max(self.min_refresh, self._due_gap()),
                                    self.slow_refresh)
            await wait_event(self._wake, period)
            if self._hurried or self._asked:
                gap = self._due_gap() if self._hurried else self.min_refresh
                await asyncio.sleep(self._last_refresh + gap - loop.time())
            self._wake.clear()
            self._hurried = self._asked = False
            self._last_refresh = loop.time()
            await self._refresh(wait_publish=False)

    def _due_gap(self) -> float:
        """Seconds between our reads once the epoch looks over: the swarm as a whole reads the key
        ``_DUE_READS_PER_S`` times a second, whatever its size (the first to find the target reached
        says so in a ready report, and the holders tell everyone else: ``_hear_notices``)."""
        return min(_MAX_DUE_GAP, max(self.fast_refresh, len(self.view.training) / _DUE_READS_PER_S))

    async def _hear_notices(self) -> None:
        """A holder we read from tells us that a peer just published a ready report (it waits to
        average), and hands it over: take it in at once. From a holder that did not hand it over
        (an older one), read at once rather than at our next poll, unless we wait in a round already."""
        with self.node.notices(self.key) as told:
            while True:
                await told.wait()
                told.clear()
                if news := self._local_news():
                    self._take(news)
                    await asyncio.sleep(_LOCAL_GAP)
                elif not self._me.ready:
                    self._asked = True
                    self._wake.set()
                    await asyncio.sleep(_NOTICE_GAP)  # (a writer cycling tags must not make us read fast)

    def _local_news(self) -> list[PeerReport]:
        """The reports our node holds that are newer than those we know (a notice's, on any peer;
        every write, on a holder)."""
        values = self.node.local_owned(self.key, _SUBKEY, max_size=_MAX_RECORD)
        reports = (parse_report(entry.value, peer) for peer, entry in values.items())
        known = self._known
        return [r for r in reports if r is not None and r.schema == self.schema
                and (r.peer not in known or r.time > known[r.peer][0].time)]

    async def _publish(self, me: PeerReport, now: float, beat: bool) -> None:
        """Store our report (a task of its own: a refresh's read, which others' news come by, does not
        wait for the slowest of the holders to take it). A change other than the count made
        meanwhile (an epoch, the ready flag) goes out as soon as this one is in."""
        wire = replace(me, time=now) if beat else me
        last = self._published
        # (the first ready report of an epoch is news the readers wait for: the holders tell them)
        news = me.ready and (last is None or not last.ready or last.epoch != me.epoch)
        try:
            await self.node.store_owned(self.key, _SUBKEY, wire.to_wire(), now + self.ttl,
                                        closest=self._closest or None, notice=me.epoch if news else None)
            self._published, self._published_at = me, wire.time
        except (DHTError, InvalidRecord, OSError) as e:
            log.debug("could not publish our progress: %s", e)
        finally:
            self._publishing = None
        if _more_than_count(self._me, me):
            # (at once, not at the next refresh: that may be a poll period away, and peers whose
            # epochs take less decide from a report epochs old that we will not come to a round)
            self._publish_current()

    async def _refresh(self, wait_publish: bool = True) -> None:
        """Read the reports (and publish ours when due); ``wait_publish``: return once it is in."""
        reach = Reach.of_node(self.node)  # relays come and go behind NAT
        if reach != self._me.reach:
            self._me = replace(self._me, addr=reach.addr, relays=reach.relays)
        me, now = self._me, time.time()
        beat = me == self._published
        # (1, 2, 4 ... s apart at first: a swarm that starts at once fills its routing tables as it
        # goes, and a first lookup that stopped short of the key's holders leaves us writing and
        # reading where most peers do not until the next one)
        since = time.monotonic() - self._looked_up_at
        full = not self._closest or since > min(self.relookup, 2.0 ** (self._lookups - 1))
        asked = None
        if not full:
            asked, self._turn = [self._closest[self._turn % len(self._closest)]], self._turn + 1
        publishing = None
        try:
            read = read_reports(self.node, self.key, asked, _WATCH if asked else 0.0)
            if not self._hidden and self._publishing is None and self._publish_due(me, now):
                # publish while reading, straight to the peers the last read found closest to the
                # key (no lookup of its own): a refresh takes one lookup, not three
                publishing = self._publishing = asyncio.ensure_future(self._publish(me, now, beat))
            result = await read
            if publishing is not None and wait_publish:
                await publishing
        except (DHTError, InvalidRecord, OSError) as e:
            log.debug("progress refresh failed: %s", e)
            return
        assert isinstance(result, tuple)
        found, read = result
        if full:  # (the nearest holders seen, not this lookup's alone: see DHTNode.nearest)
            self._looked_up_at = time.monotonic()
            self._lookups += 1
            self._closest = self.node.nearest(self.key, [*read.closest, *self._closest], self.holders)
        elif not read.closest:  # the holder asked failed: drop it, look the key up again next time
            assert asked is not None  # (not a full read: one holder was asked)
            self._closest = [c for c in self._closest if c.peer_id != asked[0].peer_id]
            self._looked_up_at = -math.inf
        # (and the writes that landed on our own node: near the key we are a holder, and the
        # holders we read are the others)
        self._take([*found, *self._local_news()])
        self._fresh.set()

    def _take(self, found: list[PeerReport]) -> None:
        """Merge reports just read into the view."""
        self._reports = reports = self._merge(found)
        if self._judge is not None:
            now = time.time()
            refused = self._judge([r for r in reports if not r.left and now - r.time <= self.ttl], self._me)
            if refused:
                self.ignore(refused)
                if self._on_refused is not None:
                    self._on_refused(refused)
        self.view = self.estimate()

    def _merge(self, found: list[PeerReport]) -> list[PeerReport]:
        """Each peer's newest report of those read so far; a peer no read has returned for ``ttl``
        seconds (its record expired) is forgotten."""
        seen = time.monotonic()
        for report in found:
            if report.schema != self.schema and report.peer != self.node.peer_id:
                self._mismatch(report)
                continue
            known = self._known.get(report.peer)
            if known is None or report.time >= known[0].time:
                self._known[report.peer] = (report, seen)
            else:
                self._known[report.peer] = (known[0], seen)
        for peer, (_, at) in list(self._known.items()):
            if seen - at > self.ttl:
                del self._known[peer]
        return [report for report, _ in self._known.values()]

    def _publish_due(self, me: PeerReport, now: float) -> bool:
        """Whether a refresh at ``now`` publishes ``me``: at once when anything but the sample count
        changed (others wait on an epoch, a ready flag, an address), or while the estimate says the
        epoch is over (its end is confirmed on published counts); a new count every ``publish_every``
        s; the same report again, as of now, before others take it for a dead peer's (a training
        thread blocked in a round or a state load reports nothing)."""
        last = self._published
        if last is None:
            return True
        age = now - self._published_at
        if me == last:
            return age > self.ttl / 5
        if _more_than_count(me, last):
            return True
        return self.view.due or age >= self.publish_every

    def _mismatch(self, report: PeerReport) -> None:
        if report.peer in self.mismatched or len(self.mismatched) >= 1000:
            return
        run = self.key.rsplit('/', 1)[0]
        theirs, ours = shards_of(report.schema), shards_of(self.schema)
        message = (f"peer {report.peer.short()} trains run {run!r} with {shards_mismatch_message(theirs, ours)}"
                   if theirs != ours else
                   f"peer {report.peer.short()} trains run {run!r} with a different "
                   f"model or codec (schema {report.schema}, ours {self.schema}): it will never average "
                   "with us; give it the same model definition and compression, or another run id")
        self.mismatched[report.peer] = message
        log.warning("%s", message)
        if self._on_mismatch is not None:
            self._on_mismatch(report.peer, message)
