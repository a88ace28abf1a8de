"""The project's tasks, called from `proj/services.py` and by the beat entry in
`proj/celery.py`."""

from dataclasses import dataclass

from celery import shared_task
from celery.utils.log import get_task_logger

from questpie_celery import LedgerTask

logger = get_task_logger(__name__)


@dataclass(frozen=True)
class Processing:
    """How to process a document (a dataclass: the app's pickle serializer carries it)."""

    language: str = "en"
    ocr: bool = False


@shared_task(bind=True, base=LedgerTask, ledger={"idempotency_key": "process:{document_id}"})
def process_document(self, document_id, processing=None):
    """Processes an uploaded document: once per document, however often it is asked."""
    processing = processing or Processing()
    logger.info(
        "processing document %s in %s (request %s)",
        document_id,
        processing.language,
        self.request.get("request_id"),
    )
    return {"document_id": document_id, "language": processing.language, "pages": 3}


@shared_task(base=LedgerTask, ledger={"singleton_key": "{index}", "queue_policy": "stately"})
def rebuild_index(index):
    """Rebuilds a search index: never two rebuilds of one index at once."""
    logger.info("rebuilt index %s", index)


@shared_task(
    autoretry_for=(ConnectionError,),
    retry_backoff=True,
    max_retries=5,
    base=LedgerTask,
    ledger={"idempotency_key": "charge:{order_id}", "secret_payload": True},
)
def charge_card(order_id, card_token):
    """Charges an order's card, once per order. The token must not be kept anywhere."""
    logger.info("charged order %s (a token of %d characters)", order_id, len(card_token))


@shared_task
def summarize_batch(results, batch_id):
    """The body of the chord over a batch's documents: a plain task, left as it was."""
    pages = sum(result["pages"] for result in results)
    logger.info("batch %s: %d documents, %d pages", batch_id, len(results), pages)
    return {"batch_id": batch_id, "documents": len(results), "pages": pages}
