"""Reading and writing broker queues directly, the same way on Redis and RabbitMQ.

Tests publish to a queue no worker reads ("idle"), take the message out with
kombu, and hand copies of it to the worker's queue: a broker delivering one
message several times, without relying on either broker's redelivery timing.
"""

from __future__ import annotations

import uuid
from typing import Any

from kombu import Connection, Exchange, Queue
from kombu.message import Message

from tests.support.stack import Stack


def idle_queue() -> str:
    """A fresh name of a queue no worker reads."""
    return f"idle-{uuid.uuid4().hex[:8]}"


def _queue(name: str) -> Queue:
    # How Celery declares a queue it creates on first use.
    return Queue(name, Exchange(name), routing_key=name)


def capture(stack: Stack, queue: str, timeout: float = 10.0) -> Message:
    """Take the one message waiting in `queue` out of the broker."""
    with Connection(stack.env["QP_TEST_BROKER"]) as conn:
        # As the stack's worker would: its app may send with pickle (adopted tasks).
        accept = stack.celery_app.conf.accept_content
        simple = conn.SimpleQueue(_queue(queue), accept=accept)
        message: Message = simple.get(block=True, timeout=timeout)
        message.ack()
        simple.close()
        return message


def queue_depth(stack: Stack, queue: str) -> int:
    """How many messages wait in `queue` (declaring it, empty, if it does not exist),
    once the stack's publishes have been sent (a ledgered one's send follows its return)."""
    assert stack.questpie.flush(30), "the stack's sends did not finish in 30 s"
    with Connection(stack.env["QP_TEST_BROKER"]) as conn:
        declared = _queue(queue)(conn.default_channel)
        declared.declare()
        _, count, _ = declared.queue_declare()
        return int(count)


def deliver(stack: Stack, message: Message, copies: int = 1, queue: str | None = None) -> None:
    """Publish byte-identical copies of `message` to the worker's queue (or `queue`)."""
    target = queue or stack.queue_name
    properties: dict[str, Any] = {
        k: v
        for k, v in message.properties.items()
        if k in ("correlation_id", "reply_to", "priority")
    }
    with Connection(stack.env["QP_TEST_BROKER"]) as conn:
        producer = conn.Producer()
        for _ in range(copies):
            producer.publish(
                message.body,
                exchange=_queue(target).exchange,
                routing_key=target,
                declare=[_queue(target)],
                headers=dict(message.headers),
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                **properties,
            )
