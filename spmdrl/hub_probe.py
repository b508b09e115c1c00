"""Whether the Hugging Face hub can answer now, decided in seconds: one TCP connection to its endpoint.

Used before a model (spmdrl.preflight) or a dataset (spmdrl.data.sources) is fetched from the hub: without
it an unreachable hub is found only after huggingface_hub's or datasets' retries (about 25 s per load, per
rank), and a firewall that drops packets holds a connect for the system's timeout (minutes).
"""

from __future__ import annotations

import os
import socket
import urllib.parse

# A TCP connection to the hub takes milliseconds when it is reachable.
CONNECT_TIMEOUT_S = 3.0
# Behind a proxy a direct connection says nothing about the hub: the download itself tells.
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def behind_proxy() -> bool:
    return any(os.environ.get(v) for v in _PROXY_VARIABLES)


def unreachable(endpoint: str) -> str | None:
    """Why a TCP connection to ``endpoint``'s host fails (None: it opens)."""
    url = urllib.parse.urlparse(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None
