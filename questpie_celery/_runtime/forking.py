"""Fork safety and exit for the package's background threads.

Prefork workers, gunicorn and multiprocessing fork processes that may hold a
thread of ours or one of its locks. A child inherits neither a running thread
nor a usable lock state, so each owner resets itself in the child.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable


def reset_in_child(method: Callable[[], None]) -> None:
    """Call the bound `method` in every child forked after this, while its object lives."""
    ref = weakref.WeakMethod(method)

    def after_fork() -> None:
        bound = ref()
        if bound is not None:
            bound()

    os.register_at_fork(after_in_child=after_fork)


def finish_at_exit(method: Callable[[], None]) -> None:
    """Call the bound `method` at interpreter exit, if its object still lives then.

    Held weakly, so registering does not keep a closed client alive for the process's life.
    """
    ref = weakref.WeakMethod(method)

    def at_exit() -> None:
        bound = ref()
        if bound is not None:
            bound()

    atexit.register(at_exit)
