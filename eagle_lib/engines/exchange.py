"""One exchange of stage 03 with a server, and whose fault its failure is (the rules: `eagle_lib.engines.faults`):
a JSON request (`request_json`), a streamed answer read as Server-Sent Events (`request_stream`: SGLang's
`/generate` and OpenAI's `/v1/completions` with ``stream: true`` send ``data: {json}`` events and end with
``data: [DONE]``), and the watch that ends an attempt at its stall or total deadline (`supervise`,
`eagle_lib.engines.deadline`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable

import aiohttp

from eagle_lib.engines.deadline import Deadlines
from eagle_lib.engines.faults import Rejected, Retryable, ServerHealth, cut_short, status_fault, stream_error


def excerpt(body: bytes | str, n: int = 300) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return text[:n].replace("\n", " ")


def retry_after(resp: aiohttp.ClientResponse) -> float:
    try:
        return float(resp.headers.get("Retry-After", 0))
    except ValueError:
        return 0.0


@contextlib.contextmanager
def transport_faults(url: str):
    """aiohttp's exceptions as Retryable faults of the kinds `faults` names."""
    try:
        yield
    except TimeoutError as e:
        raise Retryable(f"timeout ({type(e).__name__}) on {url}: {e}", kind="timeout") from None
    except aiohttp.ClientConnectorError as e:
        raise Retryable(f"{type(e).__name__} on {url}: {e}", kind="refused") from None
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as e:
        raise Retryable(f"{type(e).__name__} on {url}: {e}", kind="reset") from None


async def _check_status(resp: aiohttp.ClientResponse, url: str) -> None:
    if resp.status >= 400:
        raw = await resp.read()
        raise status_fault(resp.status, excerpt(raw), url, retry_after(resp))


def parse_json(raw: bytes, url: str):
    """A 200 body as JSON; a document cut short in transit is Retryable, anything else that is not JSON Rejected."""
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        if cut_short(text):  # framed as complete, but the document stops midway: the transport's fault
            raise Retryable(f"reply cut short ({len(raw)} bytes) from {url}: ...{text[-80:]!r}",
                            kind="truncated") from None  # fmt: skip
        raise Rejected("malformed", f"reply is not JSON: {excerpt(raw, 120)!r}") from None


async def request_json(session, method: str, url: str, body: dict | None = None, json_reply: bool = True,
                       timeout: aiohttp.ClientTimeout | None = None):  # fmt: skip
    """One HTTP exchange: JSON on 200 (`json_reply`; else None); Retryable for transient faults; Rejected for
    the rest. `timeout` replaces the session's."""
    kw = {"timeout": timeout} if timeout is not None else {}
    with transport_faults(url):
        async with session.request(method, url, json=body, **kw) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise status_fault(resp.status, excerpt(raw), url, retry_after(resp))
    return parse_json(raw, url) if json_reply else None


async def sse_events(content: aiohttp.StreamReader, url: str):
    """The ``data:`` events of a stream as parsed JSON, then None at ``[DONE]``; Retryable "truncated" when the
    stream ends before it. Lines are split here: a cumulative SGLang event outgrows aiohttp's readline limit."""
    buf = bytearray()
    while chunk := await content.readany():
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = bytes(buf[start:end]).strip()
            start = end + 1
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, other SSE fields
            data = line[5:].strip()
            if data == b"[DONE]":
                yield None
                return
            try:
                yield json.loads(data)
            except ValueError:
                raise Rejected("malformed", f"stream event is not JSON: {excerpt(data, 120)!r}") from None
        del buf[:start]
    raise Retryable(f"stream from {url} ended before [DONE]", kind="truncated")


async def request_stream(session, url: str, body: dict, merge: Callable, count: Callable[[dict], int],
                         on_tokens: Callable[[int], None], timeout: aiohttp.ClientTimeout):  # fmt: skip
    """POST `body` and read its streamed answer: each event is merged into the answer so far (`merge(acc,
    event)`, in the shape of the non-streamed reply), `on_tokens(n)` is called when its token count
    (`count(acc)`) grows. Returns the merged answer at ``[DONE]``. A server that ignores ``stream`` and answers
    with one JSON document is read as such."""
    acc, n = None, 0
    with transport_faults(url):
        async with session.post(url, json=body, timeout=timeout) as resp:
            await _check_status(resp, url)
            if "text/event-stream" not in resp.headers.get("Content-Type", ""):
                return parse_json(await resp.read(), url)
            async for event in sse_events(resp.content, url):
                if event is None:
                    if acc is None:
                        raise Rejected("malformed", f"stream from {url} ended with no answer")
                    return acc
                if not isinstance(event, dict):
                    raise Rejected("malformed", f"stream event is not an object: {excerpt(str(event), 120)}")
                if "error" in event:
                    raise stream_error(event, url)
                acc = merge(acc, event)
                if (k := count(acc)) > n:
                    n = k
                    on_tokens(n)
    raise AssertionError("unreachable: sse_events ends with None or raises")


async def supervise(coro, health: ServerHealth, deadlines: Deadlines, sent: float, streamed: bool):
    """Await one attempt (`coro`) under its deadlines: Retryable "stall" when its server delivers no token on any
    stream for `stall_s` (streamed only), "deadline" (streamed) or "timeout" (not streamed) past the total
    deadline, which is re-read as the run measures its rates. The attempt is cancelled then (its connection
    closed: the server drops the request)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            now = time.monotonic()
            end = sent + deadlines.total_s()
            if streamed and health.stalled(now, deadlines.stall_s):
                raise Retryable(f"no new token from {health.url} on any of its {health.streams} streams for "
                                f"{deadlines.stall_s:g} s: the server is stalled", kind="stall")  # fmt: skip
            if now >= end:
                what = "still streaming" if streamed else "no answer"
                raise Retryable(f"{what} after {now - sent:.0f} s, past the total deadline {end - sent:.0f} s "
                                f"({deadlines.record()})", kind="deadline" if streamed else "timeout")  # fmt: skip
            wake = min(end, health.last_token + deadlines.stall_s if streamed else end, now + 5.0)
            done, _ = await asyncio.wait({task}, timeout=max(wake - now, 0.01))
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def run_sync(coro):
    """Run a coroutine to completion from sync code, also inside Jupyter's running event loop."""
    box: dict = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
