"""jobapp's jobs in a Celery project routed as Celery's "Routing Tasks" guide routes them.

The worker's queue is bound to a topic exchange with the key pattern `task.#`, and
messages are sent to that exchange with the routing key `task.default`: a routing
key that is not the name of any queue. Configured from the same environment as
jobapp (QP_TEST_BROKER, QP_TEST_LEDGER, QP_TEST_QUEUE, QP_TEST_LEASE, QP_TEST_RELAY,
QP_TEST_RUNS); run a worker of it with `Worker(env, app="tests.support.routeapp:celery_app")`.
"""

from __future__ import annotations

import os

from celery import Celery
from kombu import Exchange, Queue

from questpie_celery import Questpie
from tests.support import jobapp

ROUTING_KEY = "task.default"


def build(
    *, broker: str, ledger: str, queue: str, lease_seconds: float = 60.0, relay: float = 2.0
) -> tuple[Celery, Questpie]:
    app = Celery("questpie_routed", broker=broker)
    exchange = Exchange(f"tasks-{queue}", type="topic")  # one per stack
    app.conf.update(
        task_queues=(Queue(queue, exchange, routing_key="task.#"),),
        task_default_queue=queue,
        task_default_exchange=exchange.name,
        task_default_exchange_type="topic",
        task_default_routing_key=ROUTING_KEY,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    questpie = Questpie(
        app,
        ledger_url=ledger,
        jobs=jobapp.JOBS,
        lease_seconds=lease_seconds,
        relay_interval=relay,
    )
    return app, questpie


def build_from_env() -> tuple[Celery, Questpie]:
    return build(
        broker=os.environ.get("QP_TEST_BROKER", "memory://"),
        ledger=os.environ.get("QP_TEST_LEDGER", "sqlite://"),
        queue=os.environ.get("QP_TEST_QUEUE", "celery"),
        lease_seconds=float(os.environ.get("QP_TEST_LEASE", "60")),
        relay=float(os.environ.get("QP_TEST_RELAY", "2")),
    )


celery_app, questpie = build_from_env()
