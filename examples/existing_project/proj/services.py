"""Where the project calls its tasks (a web view, a signal handler, a management command
would). Nothing here changed when the tasks were adopted."""

from celery import chord

from .tasks import charge_card, process_document, rebuild_index, summarize_batch


def document_uploaded(document_id, processing, request_id):
    # The web request's id travels as a custom header, to the task's `self.request`.
    return process_document.apply_async(
        (document_id, processing), headers={"request_id": request_id}
    )


def import_batch(batch_id, document_ids):
    return chord(process_document.s(d) for d in document_ids)(summarize_batch.s(batch_id))


def pay(order_id, card_token):
    return charge_card.delay(order_id, card_token)


def content_changed(index):
    return rebuild_index.delay(index)
