"""The one small HTTP client for the servers (vLLM, SGLang): JSON GET / POST with a timeout and clear errors.

    client.get_json(base + "/v1/models")
    client.post_json(base + "/v1/completions", {...}, timeout=600)
    client.get_text(base + "/metrics")

Every failure raises :class:`ServerError` naming the URL and the reason (HTTP status and the start of the body,
a refused connection, a timeout, a body that is not JSON), so a report says which server and endpoint failed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

BODY_CHARS = 300  # how much of an error body a message quotes


class ServerError(RuntimeError):
    """A request to a server failed: the message names the URL and why; ``status`` is the HTTP code or None."""

    def __init__(self, message: str, url: str, status: int | None = None):
        super().__init__(message)
        self.url, self.status = url, status


def bearer(api_key: str | None) -> dict:
    """The Authorization header of a server started with ``--api-key`` (SGLang, vLLM); {} without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request(url: str, body: dict | None = None, timeout: float = 60.0, headers: dict | None = None) -> str:
    """GET (body None) or POST a JSON body; returns the response body as text."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method="GET" if data is None else "POST")
    verb = "GET" if data is None else "POST"
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", errors="replace")[:BODY_CHARS]
        raise ServerError(f"{verb} {url}: HTTP {e.code} {e.reason}: {text}", url, e.code) from None
    except TimeoutError:
        raise ServerError(f"{verb} {url}: no answer within {timeout:g}s", url) from None
    except (urllib.error.URLError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"{verb} {url}: cannot connect ({reason})", url) from None


def _parse(url: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ServerError(f"{url}: the answer is not JSON ({e.msg}): {text[:BODY_CHARS]!r}", url) from None


def get_json(url: str, timeout: float = 60.0, headers: dict | None = None):
    """GET url and parse the JSON answer."""
    return _parse(url, request(url, None, timeout, headers))


def post_json(url: str, body: dict, timeout: float = 60.0, headers: dict | None = None):
    """POST a JSON body and parse the JSON answer."""
    return _parse(url, request(url, body, timeout, headers))


def get_text(url: str, timeout: float = 60.0, headers: dict | None = None) -> str:
    """GET url as text (Prometheus /metrics)."""
    return request(url, None, timeout, headers)
