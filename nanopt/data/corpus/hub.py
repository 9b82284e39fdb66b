"""Whether the Hugging Face hub can be reached, asked once before a download, so an offline machine fails in a
moment rather than after huggingface_hub's retries (five, 23 s of backoff, each logged on stderr).

The probe is one TCP connection to the hub's endpoint (HF_ENDPOINT, default https://huggingface.co) with a short
timeout. It is skipped where it cannot tell: behind a proxy (the libraries go through it; a direct connection may
be refused while the proxy works) and with HF_HUB_OFFLINE set (the libraries then use the local cache only, at once).
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_SECONDS = 5.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_TRUE = ("1", "true", "yes", "on")
OFFLINE_HINT = ("pass a local tokenizer.json or directory (GPT-2's vocab.json + merges.txt too), or load it once "
                "where the hub can be reached: it is then cached, and HF_HUB_OFFLINE=1 uses that cache without the "
                "network")


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks huggingface_hub for the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_unreachable() -> str | None:
    """Why the hub's endpoint cannot be reached (e.g. "huggingface.co:443: Name or service not known"), or None
    when it can, or when the probe cannot tell (a proxy, HF_HUB_OFFLINE)."""
    if hub_offline() or any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)
    host = endpoint.hostname or ""
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            return None
    except OSError as exc:  # DNS failure, refused, unreachable network, timeout
        return f"{host}:{port}: {exc.strerror or type(exc).__name__}"
