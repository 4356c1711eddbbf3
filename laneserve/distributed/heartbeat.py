"""A beat sent whenever nothing else went out for a while, so that a peer on another
machine that died is noticed even when no work flows (the command broadcast to
tensor-parallel ranks, the frame channel to a remote data-parallel worker).

The owner sends its messages under `lock` and calls `sent_now` after each; a daemon
thread checks every `poll_s` and sends one beat (under the same lock) once `interval_s`
passed without a message. A beat that fails with one of `errors` means the peer is gone:
the thread calls `on_failure` (unless stopped meanwhile) and ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Heartbeat:
    def __init__(
        self,
        beat: Callable[[], None],
        interval_s: float,
        poll_s: float,
        errors: tuple[type[BaseException], ...],
        name: str,
    ) -> None:
        self.lock = threading.Lock()  # one message at a time goes out, beats included
        self.sent = 0  # beats sent
        self._beat, self._errors, self._name = beat, errors, name
        self._interval_s, self._poll_s = interval_s, poll_s
        self._last = time.monotonic()
        self._stopped = threading.Event()

    def sent_now(self) -> None:
        """A message went out (call it holding `lock`)."""
        self._last = time.monotonic()

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        threading.Thread(target=self._run, args=(on_failure,), name=self._name, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self, on_failure: Callable[[BaseException], None]) -> None:
        while not self._stopped.wait(self._poll_s):
            if time.monotonic() - self._last < self._interval_s:
                continue
            try:
                with self.lock:
                    if self._stopped.is_set():
                        return
                    self._beat()
                    self._last = time.monotonic()
                    self.sent += 1
            except self._errors as e:
                if not self._stopped.is_set():
                    on_failure(e)
                return
