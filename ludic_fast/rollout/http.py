"""JSON over HTTP to a vLLM server, with the standard library only: the one request helper the server sampler
(`rollout.vllm_server`) and the weight-transfer control plane (`rollout.weight_transfer`) share."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def request_json(url: str, body: dict[str, Any] | None = None, *, timeout: float) -> Any:
    """POST `body` as JSON (GET without one); the decoded JSON answer, None for an empty one; RuntimeError
    naming the endpoint and the server's message on an HTTP error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"vLLM server {url}: HTTP {exc.code}: {detail}") from None
    return json.loads(raw) if raw else None


__all__ = ["request_json"]
