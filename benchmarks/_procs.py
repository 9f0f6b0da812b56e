"""Child processes for the benchmarks: own process group each, JSON-line stdout, always reaped.

    with Children() as kids:
        p = kids.spawn("peer0", [sys.executable, "benchmarks/_peer_instr.py", "peer", "--json", ...])
        ev = kids.wait_for(lambda name, e: e.get("event") == "started", timeout=30)
        ...

Every child runs in a new session (its own process group), so a Ctrl+C in the terminal reaches only
the benchmark, which then stops the children itself: SIGTERM to each group (the peers leave
cleanly), SIGKILL to whatever is left after ``grace`` seconds. A reader thread per child turns
stdout lines into ``(name, recv_time, obj)`` on one queue (non-JSON lines become ``{"text": ...}``);
stderr goes to a log file per child, whose tail is shown when something fails.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sigterm_as_exit() -> None:
    """SIGTERM to the benchmark runs its ``finally`` blocks (and so reaps the children)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_main(main: Callable[[], object]) -> None:
    """Run a benchmark's ``main``; Ctrl+C ends it with one line (its ``finally`` blocks reaped the
    children) and exit code 130, not a traceback."""
    try:
        main()
    except KeyboardInterrupt:
        print("\ninterrupted: every child process was stopped", file=sys.stderr)
        sys.exit(130)


def loadavg() -> str:
    a = os.getloadavg()
    return f"load average {a[0]:.2f} {a[1]:.2f} {a[2]:.2f} on {os.cpu_count()} cores"


class Child:
    def __init__(self, name: str, proc: subprocess.Popen, log_path: str):
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.events: list[tuple[float, dict]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


class Children:
    def __init__(self, tag: str = "bench", grace: float = 8.0, keep_logs: bool = False):
        self.tag = tag
        self.keep_logs = keep_logs  # else the log directory goes once every child ended without error
        self.grace = grace
        self.kids: dict[str, Child] = {}
        self.q: queue.Queue = queue.Queue()
        self.logdir = tempfile.mkdtemp(prefix=f"p2ptrain-{tag}-")

    def __enter__(self) -> Children:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop_all()
        if exc_type is None and not self.keep_logs:  # kept when something went wrong
            shutil.rmtree(self.logdir, ignore_errors=True)

    def spawn(self, name: str, argv: list[str], env: dict | None = None, stdin: bool = False,
              wrap: Callable[[list[str]], list[str]] | None = None) -> Child:
        """Start ``argv`` (``wrap`` may turn it into another command line first, e.g. a test bed
        host's ``ip netns exec``, which execs in place: the child is still the process itself)."""
        log_path = os.path.join(self.logdir, f"{name}.log")
        if wrap is not None:
            argv = list(wrap(argv))
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH", "")] if p)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
                                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                    text=True, bufsize=1, start_new_session=True)
        child = Child(name, proc, log_path)
        self.kids[name] = child
        threading.Thread(target=self._pump, args=(child,), daemon=True).start()
        return child

    def _pump(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            now = time.time()
            obj = event_of(line)
            if obj is None:
                continue
            child.events.append((now, obj))
            self.q.put((child.name, now, obj))
        self.q.put((child.name, time.time(), {"event": "_eof"}))

    def send(self, name: str, line: str) -> None:
        p = self.kids[name].proc
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def wait_for(self, pred: Callable[[str, dict], bool], timeout: float,
                 on_event: Callable[[str, float, dict], None] | None = None) -> tuple[str, float, dict]:
        """The next queued event matching ``pred`` (others go to ``on_event``); TimeoutError after
        ``timeout`` s; RuntimeError when a child exits before it is found."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching event within {timeout:.0f} s")
            try:
                name, t, obj = self.q.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if on_event is not None:
                on_event(name, t, obj)
            if pred(name, obj):
                return name, t, obj
            if obj.get("event") == "_eof" and not pred(name, obj):
                rc = self.kids[name].proc.wait()
                if rc != 0:
                    raise RuntimeError(f"{name} exited with code {rc}:\n{self.kids[name].stderr_tail()}")

    def wait_exit(self, names: list[str], timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        out: dict[str, int | None] = {}
        for n in names:
            try:
                out[n] = self.kids[n].proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out[n] = None
        return out

    def stop_all(self) -> None:
        """SIGTERM every child's process group, SIGKILL after ``grace`` s, reap all."""
        live = [c for c in self.kids.values() if c.proc.poll() is None]
        for c in live:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.kids.values():
            if c.proc.poll() is None:
                _signal_group(c.proc, signal.SIGKILL)
            c.proc.wait()
        self.kids.clear()


def event_of(line: str) -> dict | None:
    """A child's stdout line as an event: its JSON object, else ``{"text": line}``; None if blank."""
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return {"text": line}
    return obj if isinstance(obj, dict) else {"text": line}


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass


def peak_rss() -> int:
    """This process's peak resident set size (``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
