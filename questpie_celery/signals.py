"""Signals a program can connect to, in Celery's own signal style.

from questpie_celery.signals import publish_suppressed

@publish_suppressed.connect
def on_suppressed(sender, job_name, singleton_key, policy, **kwargs): ...
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

#: A publish that a queue policy suppressed (publish() returned None). Sent with
#: `sender` = the job name, and `job_name`, `singleton_key`, `policy` keyword arguments.
publish_suppressed = Signal(name="questpie_celery.publish_suppressed")

#: A delivered run set aside because its slot was busy. Sent with `sender` = the job
#: name, and `job_name`, `dispatch_id`, `singleton_key` keyword arguments.
run_parked = Signal(name="questpie_celery.run_parked")

#: A dispatch was cancelled (`queue.cancel(...)`, or the CLI's `dispatches cancel`) and
#: will not run again. Sent with `sender` = the job name, and `job_name`, `dispatch_id`,
#: `started` (True when it was running: it goes on, is not retried, ends as cancelled).
dispatch_cancelled = Signal(name="questpie_celery.dispatch_cancelled")
