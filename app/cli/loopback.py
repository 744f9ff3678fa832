"""Requests of the CLI to this machine's own API (``coserve up``'s, on 127.0.0.1) go to it directly, never through
the proxy HTTP_PROXY/HTTPS_PROXY/ALL_PROXY name: httpx honours them for every host NO_PROXY does not name, loopback
included, and a proxy elsewhere cannot reach this machine's loopback (a user behind a corporate proxy saw `coserve
up` wait out its start-up timeout on its own API, and every command answered by the proxy's 502)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine's loopback: localhost (RFC 6761), 127.0.0.0/8 or ::1."""
    try:
        host = (urlsplit(url).hostname or "").rstrip(".").lower()
    except ValueError:  # a malformed URL: httpx says what is wrong with it
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def trust_env(url: str) -> bool:
    """httpx's ``trust_env`` for requests to ``url``: False for a loopback host, so that no proxy from the environment
    comes between the CLI and a local API; True elsewhere (a remote API behind the user's proxy)."""
    return not is_loopback(url)
