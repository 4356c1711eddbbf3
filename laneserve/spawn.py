"""Starting the engine's helper processes (the worker; ranks use the same helper).

A helper process never sees the terminal's Ctrl-C: it runs in its own session, so
the SIGINT that the terminal sends to its foreground process group reaches only the
user's process, which decides what an interrupt means (stop a reply, abort the
requests, leave). The helper also ignores SIGINT itself, in case one is sent to it
directly. A helper ends when the engine closes its pipe or kills it, and it notices
the engine's death as end-of-file on that pipe.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence


def spawn_helper(cmd: Sequence[str], pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start `cmd` in a new session (no controlling terminal, so neither the
    terminal's SIGINT nor its hang-up reaches it), inheriting `pass_fds`."""
    return subprocess.Popen(list(cmd), pass_fds=tuple(pass_fds), start_new_session=True)


def ignore_interrupts() -> None:
    """Called first thing in a helper process: SIGINT is the user's process's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
