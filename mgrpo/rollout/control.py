"""JSON control calls to rollout servers (stdlib only, no event loop): what the remote engines and the collective
transports share."""
from __future__ import annotations

import os


class ServerCallError(RuntimeError):
    """A control call that failed; the message names the server, the route and why."""


def http_json(url: str, method: str, path: str, body: dict | None, headers: dict, timeout: float, context=None,
              name: str = "") -> dict:
    """One JSON call to a rollout server (`body` a dict, or bytes sent as they are); any failure is a ServerCallError
    naming it. A body that is not JSON (SGLang's /flush_cache answers text) comes back as {"text": ...}."""
    import json
    import urllib.error
    import urllib.request

    raw = isinstance(body, (bytes, bytearray))  # a file's bytes (a LoRA adapter), else JSON
    data = bytes(body) if raw else (json.dumps(body).encode() if body is not None else None)
    kind = "application/octet-stream" if raw else "application/json"
    req = urllib.request.Request(url + path, data=data, method=method, headers=dict(
        headers, **({"Content-Type": kind} if data is not None else {})))
    name = name or url.split("://", 1)[-1]
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            raw = resp.read()
            return json.loads(raw) if raw.strip().startswith((b"{", b"[")) else {"text": raw.decode(errors="replace")}
    except urllib.error.HTTPError as exc:
        raise ServerCallError(f"rollout server {name}: {method} {path} -> {exc.code} "
                              f"{exc.read()[:300].decode(errors='replace')}") from None
    except (OSError, ValueError) as exc:
        raise ServerCallError(f"rollout server {name}: {method} {path} failed: {exc}") from None


def tls_context(ca_file: str = ""):
    """The TLS context every https call to the servers uses: certificates checked, against `ca_file` if given."""
    import ssl

    return ssl.create_default_context(cafile=os.path.expanduser(ca_file) if ca_file else None)
