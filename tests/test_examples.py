"""Examples are documentation: each must keep running and printing what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_dht_kv_example_runs():
    out = subprocess.run([sys.executable, str(EXAMPLES / "dht_kv.py")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "bob reads demo/config: {'lr': 0.0003, 'batch': 32}" in out.stdout
    assert "members: ['alice', 'bob']" in out.stdout
    assert "bob cannot overwrite alice's entry" in out.stdout
