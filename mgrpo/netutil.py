"""Address checks shared by the rollout server's launcher (what it binds) and the client config (what it calls)."""

from __future__ import annotations

import ipaddress
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
