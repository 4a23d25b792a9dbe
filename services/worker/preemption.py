"""A preemption notice reaching a worker: the cloud's (or Kubernetes') SIGTERM before a
spot node is taken back. The worker does not die on it: it finishes the step it is in
and says so in that step's report (``StepReport.leaving``); the
launcher then replaces the workers at that step boundary from the state servers' live
state, a planned loss, without waiting for the process or its node to fail
(cluster/live_recovery.py, docs/operations.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

NOTICE_SIGNAL = signal.SIGTERM
"""What a spot reclaim, a Kubernetes pod deletion and a node drain send."""


class PreemptionNotice:
    """Whether this process has been told it will be taken away (:data:`NOTICE_SIGNAL`)
    while in a step (:meth:`stepping`).

    Installed on the main thread (where Ray runs a worker actor's calls and Python runs
    signal handlers); elsewhere it stays unset. A notice between steps is handled as
    before it was installed (Ray's handler ends the process; the launcher recovers the
    lost worker live), so that stopping Ray stops an idle worker at once."""

    def __init__(self, what: str) -> None:
        self._what = what
        self.received = False
        self._stepping = False
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(NOTICE_SIGNAL, self._notice)

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """While a step runs, a notice waits for its end."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def _notice(self, signum: int, frame: FrameType | None) -> None:
        if not self._stepping:
            if callable(self._previous):
                self._previous(signum, frame)
            else:  # the default action, as if never installed
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if not self.received:
            logger.warning("%s: %s received: leaving after the step in progress", self._what, signal.strsignal(signum))
        self.received = True
