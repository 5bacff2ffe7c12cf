"""The outbox: finished tasks' results and failures until the coordinator has them.

Kept on disk (one small JSON file per task, written atomically), so a worker that was
killed or restarted still delivers what it finished: the output blob was uploaded before
the result entered the outbox, and the next hello names the task as still held.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, MutableMapping
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from idlegrid import protocol

log = logging.getLogger(__name__)

Message = protocol.Result | protocol.Failure
_adapter: TypeAdapter[Message] = TypeAdapter(Message)


class Outbox(MutableMapping[int, Message]):
    """A dict of task id to message that mirrors itself into `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._messages: dict[int, Message] = {}
        for path in sorted(directory.glob("*.json")):
            try:
                message = _adapter.validate_json(path.read_bytes())
            except (OSError, ValidationError) as exc:
                log.warning("dropping unreadable outbox entry %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            self._messages[message.task_id] = message
        if self._messages:
            log.info("outbox: %d finished tasks from before a restart", len(self._messages))

    def _path(self, task_id: int) -> Path:
        return self.directory / f"{task_id}.json"

    def __getitem__(self, task_id: int) -> Message:
        return self._messages[task_id]

    def __setitem__(self, task_id: int, message: Message) -> None:
        path = self._path(task_id)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(message.model_dump_json())
        os.replace(scratch, path)
        self._messages[task_id] = message

    def __delitem__(self, task_id: int) -> None:
        del self._messages[task_id]
        with contextlib.suppress(FileNotFoundError):
            self._path(task_id).unlink()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._messages))

    def __len__(self) -> int:
        return len(self._messages)
