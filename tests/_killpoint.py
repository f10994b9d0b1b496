"""Run `python -m eyas.cli ARGS` and SIGKILL it at a chosen point: the fault-injection tests' launcher.

    python tests/_killpoint.py prepare chat.jsonl --out OUT ...

Environment:
  EYAS_KILL_ROOT    file events count only under this folder (the stage's outputs)
  EYAS_KILL_EVENT   SIGKILL just before the Nth file event (0: never)
  EYAS_KILL_AFTER   SIGKILL this many seconds after the first file event (0: never): timed from the
                    stage's own work, not from a start that imports take a varying time to pass
  EYAS_KILL_COUNT   when the run ends by itself, write here as JSON the number of file events seen
                    ("events") and the seconds after the start of the first and the last ("first", "last")

A file event is what changes the output folder, seen through Python's audit hooks: an `open` for
writing, a rename or replace, a remove, a mkdir or rmdir. Writes by native code (safetensors' Rust
writer) are not seen, but the renames that publish them are. SIGKILL cannot be caught: nothing of
the stage's own clean-up runs, as after an OOM kill or a preempted machine.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import threading
import time

STARTED = time.monotonic()
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
CHANGES = {"os.rename": 2, "os.replace": 2, "os.remove": 1, "os.unlink": 1, "os.mkdir": 1, "os.rmdir": 1,
           "shutil.rmtree": 1, "shutil.move": 2, "os.truncate": 1}


def _paths(event: str, args: tuple) -> list[str]:
    """The paths an event touches, when it changes something (else [])."""
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & WRITE_FLAGS)
        candidates = [path] if writing else []
    else:
        candidates = list(args[:CHANGES.get(event, 0)])
    return [os.fsdecode(p) for p in candidates if isinstance(p, (str, bytes, os.PathLike))]


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root = os.path.realpath(os.environ["EYAS_KILL_ROOT"])
    kill_event = int(os.environ.get("EYAS_KILL_EVENT", "0"))
    kill_after = float(os.environ.get("EYAS_KILL_AFTER", "0"))
    count_file = os.environ.get("EYAS_KILL_COUNT")
    pid, seen, times = os.getpid(), 0, []

    def hook(event: str, args: tuple) -> None:
        nonlocal seen
        if (event != "open" and event not in CHANGES) or os.getpid() != pid:  # forked workers inherit hooks
            return
        if any(os.path.realpath(os.path.abspath(p)).startswith(root) for p in _paths(event, args)):
            seen += 1
            times[1:] = [time.monotonic() - STARTED]
            if seen == kill_event:
                _kill()
            if seen == 1 and kill_after > 0:
                timer = threading.Timer(kill_after, _kill)
                timer.daemon = True
                timer.start()

    def report() -> None:
        with open(count_file, "w") as f:
            json.dump({"events": seen, "first": times[0] if times else 0.0, "last": times[-1] if times else 0.0}, f)

    if count_file:
        atexit.register(report)
    sys.addaudithook(hook)
    sys.argv = ["eyas", *sys.argv[1:]]
    runpy.run_module("eyas.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
