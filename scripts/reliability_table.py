"""Regenerate docs/reliability.md: run the fault-injection and bad-input tests, which render the table from
the cases they define (tests/_reliability.py) and the outcomes they saw. A test fails when the committed
table and the cases disagree, so run this after adding or changing a case.

    .venv/bin/python scripts/reliability_table.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
env = {**os.environ, "EYAS_WRITE_RELIABILITY": "1", "EYAS_NO_PROGRESS": "1"}
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_reliability.py"], cwd=root, env=env))
