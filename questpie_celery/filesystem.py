"""kombu's `filesystem://` transport, with messages a reader cannot take half-written.

kombu's own transport creates a message's file under its final name and then writes
into it. A worker polling the folder can take the file in between: it reads nothing,
fails to decode it and deletes it, and the message is gone. On a loaded machine this
happened to about one message in eleven (3,000 sent from one thread while another
read). Here the file is written under a name no reader picks up and then renamed into
place, which on one filesystem is atomic: a reader sees the whole message or none.

A `Questpie` on a Celery app whose broker is `filesystem://` uses this transport unless
the app chose one (`broker_transport`); the folders and options are kombu's, and the two
transports can share a folder. A writer killed between the write and the rename leaves
its hidden file behind, unread (a message it never finished sending); like kombu's, a
write is not synced to disk before the rename.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps

#: What `broker_transport` names for it.
TRANSPORT = "questpie_celery.filesystem:Transport"


class Channel(filesystem.Channel):
    # kombu's own two declarations of `_put` disagree; this is the filesystem one.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        # kombu's name, so readers order and route the file exactly as they would its own.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # A reader takes only names ending in ".<queue>.msg".
        partial = os.path.join(self.data_folder_out, f".{name}.partial")
        body = dumps(payload).encode()  # type: ignore[no-untyped-call]  # before any file
        try:
            with open(partial, "wb") as file:
                file.write(body)
            os.replace(partial, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
