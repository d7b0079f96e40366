"""Lua script calls to Redis from one event loop, sent together: every call made during one turn of the
loop goes out in one pipeline (one write, one read, one pass through redis-py's connection pool).

redis-py's asyncio client costs about 150-200 us of CPU per command on this project's machines (its
pool, encoding and parsing in Python), which is most of what a per-key limit costs the router; with
many requests in flight, their limit checks share a pipeline and that cost. Scripts are called by
SHA-1 (EVALSHA) and loaded again when Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH); only
the calls that failed that way are sent again, so no script runs twice.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
from typing import Any

from redis.exceptions import NoScriptError


@functools.lru_cache(maxsize=16)
def script_sha(script: str) -> str:
    """The SHA-1 Redis names a script by."""
    return hashlib.sha1(script.encode(), usedforsecurity=False).hexdigest()


class ScriptBatcher:
    """Collects `call`s made in one loop turn and sends them as one pipeline. One per event loop."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pending: list[tuple[str, list[str], list[Any], asyncio.Future[Any]]] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def call(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """Run `script` with `keys` and `args`; its reply, or the exception Redis or the network raised."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._send)
        return await future

    def _send(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[str, list[str], list[Any], asyncio.Future[Any]]]) -> None:
        try:
            replies = await self._execute(batch)
            missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if missing:  # Redis forgot the scripts: load them, send those calls (and only those) again
                for script in {batch[i][0] for i in missing}:
                    await self.client.script_load(script)
                again = await self._execute([batch[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except Exception as exc:  # noqa: BLE001  the connection failed: every caller gets the error
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (*_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _execute(self, batch: list[tuple[str, list[str], list[Any], asyncio.Future[Any]]]) -> list[Any]:
        async with self.client.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in batch:
                pipe.evalsha(script_sha(script), len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))
