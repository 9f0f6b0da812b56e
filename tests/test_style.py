"""The tree passes its linter (ruff, configured in pyproject.toml: pyflakes, pycodestyle, 120 columns)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_passes():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, ("ruff check found problems (run `ruff check .` in the project's root):\n"
                                  f"{done.stdout[-4000:]}{done.stderr[-2000:]}")
