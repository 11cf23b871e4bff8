"""Address checks shared by the rollout server's launcher (what it binds) and the client config (what it calls),
and the JSON control calls to rollout servers (httpx, synchronous: no event loop) that the remote engines and the
collective transports share."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit


def is_loopback(host: str, resolve: bool = True) -> bool:
    """Whether `host` is a loopback address; a name is resolved when `resolve` (else only `localhost` counts)."""
    if not resolve and host == "localhost":
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host) if resolve else host).is_loopback
    except (OSError, ValueError):
        return False


def is_loopback_url(url: str) -> bool:
    """Whether the URL's host is a loopback address, without a name lookup."""
    return is_loopback(urlsplit(url).hostname or "", resolve=False)


class ServerCallError(RuntimeError):
    """A control call that failed; the message names the server, the route and why."""


def http_json(
    url: str, method: str, path: str, body: dict | None, headers: dict, timeout: float, context=None, name: str = ""
) -> dict:
    """One JSON call to a rollout server (`body` a dict, or bytes sent as they are); any failure is a ServerCallError
    naming it. A body that is not JSON (SGLang's /flush_cache answers text) comes back as {"text": ...}."""
    import json

    import httpx

    raw = isinstance(body, (bytes, bytearray))  # a file's bytes (a LoRA adapter), else JSON
    content = bytes(body) if raw else (json.dumps(body).encode() if body is not None else None)
    if content is not None:
        headers = dict(headers, **{"Content-Type": "application/octet-stream" if raw else "application/json"})
    name = name or url.split("://", 1)[-1]
    try:
        resp = httpx.request(
            method,
            url + path,
            content=content,
            headers=headers,
            timeout=timeout,
            verify=context if context is not None else True,
        )
    except httpx.HTTPError as exc:
        raise ServerCallError(f"rollout server {name}: {method} {path} failed: {exc or type(exc).__name__}") from None
    if resp.status_code >= 400:
        raise ServerCallError(
            f"rollout server {name}: {method} {path} -> {resp.status_code} "
            f"{resp.content[:300].decode(errors='replace')}"
        )
    try:
        return (
            json.loads(resp.content)
            if resp.content.strip().startswith((b"{", b"["))
            else {"text": resp.content.decode(errors="replace")}
        )
    except ValueError as exc:
        raise ServerCallError(f"rollout server {name}: {method} {path}: the answer is not JSON ({exc})") from None


def tls_context(ca_file: str = ""):
    """The TLS context every https call to the servers uses: certificates checked, against `ca_file` if given."""
    import ssl

    return ssl.create_default_context(cafile=os.path.expanduser(ca_file) if ca_file else None)
