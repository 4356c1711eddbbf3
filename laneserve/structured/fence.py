"""`CommitFence`: the device lane waits here until every earlier step is reclaimed.

A grammar's next mask depends on the tokens of the step before, which only the
output lane reads back (and commits to the matchers). With two steps in flight
the device lane runs step N+1's forward while step N is being reclaimed; before
sampling a step that has grammar rows it waits on this fence, so the masks see
every committed token (vLLM's async scheduling does the same: the forward
overlaps, the sampling waits for the bitmask).
"""

from __future__ import annotations

import threading


class CommitFence:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._handed_on = 0  # steps the device stage has passed to the output stage
        self._reclaimed = 0  # steps the output stage has finished with

    def handed_on(self) -> None:
        """Called by the device stage once per step (failed steps included)."""
        with self._cond:
            self._handed_on += 1

    def reclaimed(self) -> None:
        """Called by the output stage once per step, after committing its tokens."""
        with self._cond:
            self._reclaimed += 1
            self._cond.notify_all()

    def wait(self) -> None:
        """Until every step handed on so far has been reclaimed."""
        with self._cond:
            self._cond.wait_for(lambda: self._reclaimed >= self._handed_on)
