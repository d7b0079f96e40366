"""A decode worker that dies in the middle of a line: a TCP proxy in front of a real decode worker.

    python -m tests.inference.router.torn_proxy --port P --upstream 127.0.0.1:Q --after-tokens 5 \
        --arm-file /tmp/armed --mode drop

Bytes from the router go to the worker unchanged. Responses from the worker are relayed chunk by
chunk (HTTP/1.1 chunked framing, which is how workers stream NDJSON) while `--arm-file` does not
exist. Once it exists, the first streamed response that has relayed `--after-tokens` token lines
gets only part of its next token line, cut inside a multi-byte UTF-8 character when the line has
one, else in the middle of the line, and then the proxy dies (exit without closing anything
cleanly, so its port refuses connections afterwards, as a killed worker's would):

- `drop`: the chunk is cut short and the connection closes (the kill landed inside a write);
- `end`: the torn part is sent as a complete chunk followed by the body's last chunk (the response
  ends cleanly on a partial line, as a worker that wrote half a line and returned would).

The proxy prints `cut` to stdout when it cut a line.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

TOKEN_MARK = b'"type":"token"'


def cut_point(line: bytes) -> int:
    """Where to tear `line`: inside its first multi-byte UTF-8 character, else in its middle."""
    for i, byte in enumerate(line):
        if byte >= 0xC0:  # a lead byte: cutting after it leaves a broken sequence
            return i + 1
    return max(1, len(line) // 2)


class Proxy:
    """Relays connections to the upstream worker until it tears a line, then exits the process."""

    def __init__(self, upstream: tuple[str, int], after_tokens: int, arm_file: Path, mode: str) -> None:
        self.upstream = upstream
        self.after_tokens = after_tokens
        self.arm_file = arm_file
        self.mode = mode

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """One router connection: requests relayed as they are, responses through `_responses`."""
        try:
            worker_r, worker_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        up = asyncio.ensure_future(self._pipe(client_r, worker_w))
        try:
            await self._responses(worker_r, client_w)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            up.cancel()
            client_w.close()
            worker_w.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _responses(self, worker: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        while True:  # one response per pass; ends with the connection
            head = await worker.readuntil(b"\r\n\r\n")
            client.write(head)
            headers = head.lower()
            if b"transfer-encoding: chunked" not in headers:
                length = 0
                for line in headers.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                client.write(await worker.readexactly(length))
                await client.drain()
                continue
            tokens = 0
            while True:  # one chunk per pass
                size_line = await worker.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                data = await worker.readexactly(size + 2)  # the chunk and its CRLF
                if size and tokens >= self.after_tokens and TOKEN_MARK in data and self.arm_file.exists():
                    await self._tear(client, data[:size])
                client.write(size_line + data)
                await client.drain()
                tokens += data.count(TOKEN_MARK)
                if size == 0:
                    break

    async def _tear(self, client: asyncio.StreamWriter, chunk: bytes) -> None:
        start = chunk.index(TOKEN_MARK)
        start = chunk.rfind(b"\n", 0, start) + 1  # the token line's first byte
        end = chunk.find(b"\n", start)
        line = chunk[start:end if end >= 0 else len(chunk)]
        torn = chunk[:start] + line[:cut_point(line)]
        if self.mode == "drop":
            client.write(b"%x\r\n" % len(chunk) + torn)
        else:
            client.write(b"%x\r\n" % len(torn) + torn + b"\r\n0\r\n\r\n")
        await client.drain()
        transport = client.transport
        for _ in range(100):  # bounded: until the kernel has the bytes
            if transport.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.01)
        print("cut", flush=True)
        client.close()
        await asyncio.sleep(0.05)
        os._exit(0)  # every other connection and the listening socket die with the process


async def serve(args: argparse.Namespace) -> None:
    """Listen on 127.0.0.1:`--port` until a line is torn."""
    host, port = args.upstream.rsplit(":", 1)
    proxy = Proxy((host, int(port)), args.after_tokens, Path(args.arm_file), args.mode)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", args.port)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and run the proxy."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="host:port of the real decode worker")
    p.add_argument("--after-tokens", type=int, default=5)
    p.add_argument("--arm-file", required=True, help="lines are torn only while this file exists")
    p.add_argument("--mode", choices=["drop", "end"], default="drop")
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
