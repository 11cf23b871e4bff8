"""Length-prefixed JSON messages over local (Unix-domain) sockets: the wire between a trainer rank, its
colocated engine process and that engine's worker. JSON only, never pickle; every request carries the
engine's token, and the socket lives in a 0700 directory of the user who started the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import struct
import tempfile

MAX_MESSAGE = 1 << 30  # a JSON message larger than this is refused as garbage
_HEADER = struct.Struct("<Q")


class RpcError(RuntimeError):
    """The other side answered with an error, or the connection broke."""


def private_dir(prefix: str = "mgrpo-") -> str:
    """A fresh 0700 directory for sockets (mkdtemp already creates it 0700)."""
    return tempfile.mkdtemp(prefix=prefix)


def new_token() -> str:
    return secrets.token_hex(16)


def encode(obj) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _HEADER.pack(len(data)) + data


def _size(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_MESSAGE:
        raise RpcError(f"refusing a {n}-byte message (limit {MAX_MESSAGE})")
    return n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise RpcError("connection closed by the other side")
        buf += chunk
    return bytes(buf)


def send(sock: socket.socket, obj) -> None:
    sock.sendall(encode(obj))


def recv(sock: socket.socket):
    return json.loads(_recv_exact(sock, _size(_recv_exact(sock, _HEADER.size))))


async def async_send(writer: asyncio.StreamWriter, obj) -> None:
    writer.write(encode(obj))
    await writer.drain()


async def async_recv(reader: asyncio.StreamReader):
    try:
        header = await reader.readexactly(_HEADER.size)
        return json.loads(await reader.readexactly(_size(header)))
    except asyncio.IncompleteReadError:
        raise RpcError("connection closed by the other side") from None


def connect(path: str, timeout: float) -> socket.socket:
    """A connection whose every send and receive fails after `timeout` seconds (socket.timeout, an OSError)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def call(path: str, token: str, op: str, timeout: float = 600.0, **kwargs):
    """One blocking request/reply on a fresh connection; raises RpcError with the other side's message."""
    with connect(path, timeout) as sock:
        send(sock, dict(kwargs, op=op, token=token))
        reply = recv(sock)
    if not reply.get("ok"):
        raise RpcError(reply.get("error", "unknown error"))
    return reply.get("result")


async def async_call(path: str, token: str, op: str, **kwargs):
    reader, writer = await asyncio.open_unix_connection(path, limit=MAX_MESSAGE)
    try:
        await async_send(writer, dict(kwargs, op=op, token=token))
        reply = await async_recv(reader)
    finally:
        writer.close()
    if not reply.get("ok"):
        raise RpcError(reply.get("error", "unknown error"))
    return reply.get("result")


def listener(path: str) -> socket.socket:
    """A listening Unix socket only this user can reach (its directory is 0700; the socket itself 0600)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(4)
    return sock
