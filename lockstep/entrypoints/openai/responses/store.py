"""Stored responses (store: true): each response with the conversation items it answered, so
previous_response_id can continue it and GET /v1/responses/{id} return it. Bounded by count and
by bytes (oldest evicted first; an evicted id gets a 404 that says so), kept apart per API key
(the `owner`), and optionally persisted to a file, rewritten whole and atomically (a temporary
file, fsync, os.replace): a crash leaves the previous file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.entrypoints.tokenizer_manager import RequestError

FORMAT_VERSION = 1
# How many evicted ids are remembered, to tell "evicted" from "never stored" in the 404.
_EVICTED_MEMORY = 65_536


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as sent
    items: list[dict[str, Any]]  # the conversation's input items, earlier turns included


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int, path: Path | None = None) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.path = path
        # (owner, id) -> the record's JSON text (its size is what the byte bound counts).
        self._records: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._bytes = 0
        self._evicted: deque[tuple[str, str]] = deque(maxlen=_EVICTED_MEMORY)
        self._evicted_set: set[tuple[str, str]] = set()
        self._write_lock = threading.Lock()
        self._version = 0  # counts changes: a write never replaces a newer snapshot's file
        self._written = 0
        if path is not None and path.exists():
            self._load(path)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, owner: str, record: StoredResponse) -> None:
        key = (owner, record.response["id"])
        text = json.dumps({"owner": owner, "response": record.response, "items": record.items},
                          separators=(",", ":"))
        self._insert(key, text)

    def get(self, owner: str, response_id: str) -> StoredResponse:
        text = self._records.get((owner, response_id))
        if text is None:
            raise self._not_found(owner, response_id)
        data = json.loads(text)
        return StoredResponse(data["response"], data["items"])

    def delete(self, owner: str, response_id: str) -> None:
        text = self._records.pop((owner, response_id), None)
        if text is None:
            raise self._not_found(owner, response_id)
        self._version += 1
        self._bytes -= len(text)

    def conversation(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        """The items a continuation of `response_id` starts from: its input, then its output."""
        stored = self.get(owner, response_id)
        return [*stored.items, *stored.response["output"]]

    def _insert(self, key: tuple[str, str], text: str) -> None:
        self._version += 1
        self._records[key] = text
        self._bytes += len(text)
        while self._records and (len(self._records) > self.max_items
                                 or self._bytes > self.max_bytes):
            old_key, old_text = self._records.popitem(last=False)
            self._bytes -= len(old_text)
            if len(self._evicted) == self._evicted.maxlen:
                self._evicted_set.discard(self._evicted[0])
            self._evicted.append(old_key)
            self._evicted_set.add(old_key)

    def _not_found(self, owner: str, response_id: str) -> RequestError:
        if (owner, response_id) in self._evicted_set:
            return RequestError(
                f"Response '{response_id}' was evicted from the response store, which keeps "
                f"the newest {self.max_items} responses and at most {self.max_bytes} bytes "
                "(--responses-store-max-items, --responses-store-max-bytes)", 404)
        return RequestError(f"No response with id '{response_id}' is stored", 404)

    # -- persistence ----------------------------------------------------------------------------

    def snapshot(self) -> tuple[int, bytes]:
        """The file's content now, with its version (taken on the event loop; written by
        `write` off it)."""
        return self._version, (f'{{"version":{FORMAT_VERSION},"records":['.encode()
                               + ",".join(self._records.values()).encode() + b"]}")

    def write(self, snapshot: tuple[int, bytes]) -> None:
        """Atomically replace the file with a `snapshot`, unless a newer one is written
        already (two writes may finish out of order)."""
        version, content = snapshot
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with self._write_lock:
            if version <= self._written:
                return
            with open(tmp, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._written = version

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_bytes())
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('version')!r}, expected "
                                 f"{FORMAT_VERSION}")
            for rec in data["records"]:
                text = json.dumps(rec, separators=(",", ":"))
                self._insert((rec["owner"], rec["response"]["id"]), text)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"--responses-store-file {path}: cannot load it ({e})") from e
