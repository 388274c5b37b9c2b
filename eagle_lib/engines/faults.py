"""How stage 03's HTTP engines tell whose fault a failed exchange is: the server's (`Retryable`: try again,
elsewhere when possible) or maybe the request's (`Rejected`); each server's rotation state (`ServerHealth`); a
JSON body cut short in transit (`cut_short`); and when a run's failures are clearly past its bound
(`ErrorBudget`); the work queue that gives a rejected request its second opinion at once (`WorkQueue`).

The rules (`eagle_lib.engines.http` applies them):
- refused, reset, HTTP 5xx, a body cut short: the server's fault. The request goes back to the queue uncharged,
  unless the same server has failed it before (then it is charged a retry: the server answers others, not it).
  A refused connection takes the server out of rotation at once; the others after `IN_A_ROW` in a row with no
  answer between (one 5xx behind a router is one of its workers, not the router).
- a non-streamed answer past its total deadline (`eagle_lib.engines.deadline`): "timeout", the request's,
  charged; the server is out at once. Streamed: no new token from a server on any of its requests for `stall_s`
  is a "stall", the server's (out at once); a request still receiving tokens past its total deadline is a
  "deadline", charged to it (the server counts it toward `IN_A_ROW`: it is alive, but far slower than the run).
- HTTP 429: back-pressure, no one's fault: the request goes back uncharged, the server stays in rotation but
  takes no new work until Retry-After (or the backoff) has passed.
- other 4xx, abort and malformed replies: `Rejected`. One server's rejection is not enough to fail a request (a
  misconfigured node rejects everything at once): it is tried again, on another server when one is in rotation,
  and fails for good at its second rejection. Rejections count toward the server's `IN_A_ROW` like faults.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from eagle_lib.engines.base import Request

IN_A_ROW = 3  # faults or rejections in a row, no answer between, that take a server out of rotation
_SCALAR_PREFIX = re.compile(r"-?(\d+(\.\d*)?([eE][+-]?\d*)?)?|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?")


class Retryable(Exception):
    """A transient fault: try again later (maybe elsewhere); `kind`: refused | reset | timeout | http_5xx |
    http_429 | truncated | stall | deadline."""

    def __init__(self, detail: str, retry_after: float = 0.0, kind: str = "reset"):
        super().__init__(detail)
        self.retry_after, self.kind = retry_after, kind


class Rejected(Exception):
    """A reply that refuses or botches this request (4xx, abort, malformed): goes to errors.jsonl with `reason`
    once a second rejection confirms it."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def status_fault(status: int, body: str, url: str, retry_after: float) -> Exception | None:
    """The exception an HTTP status means (None for a success): 429 and 5xx are Retryable, other 4xx Rejected."""
    if status == 429 or status >= 500:
        kind = "http_429" if status == 429 else "http_5xx"
        return Retryable(f"HTTP {status} from {url}: {body}", retry_after, kind)
    if status >= 400:
        return Rejected(f"http_{status}", body)
    return None


def stream_error(event: dict, url: str) -> Exception:
    """An error event inside a stream (vLLM and SGLang send `{"error": {message, code}}`): Retryable when the
    server says so or its code is 5xx, else Rejected."""
    err = event.get("error")
    err = err if isinstance(err, dict) else {"message": str(err)}
    code = err.get("code")
    code = code if isinstance(code, int) else 500 if err.get("retryable") else 0
    text = f"error event in the stream from {url}: {str(err.get('message', err))[:300]}"
    if err.get("retryable") or code >= 500:
        return Retryable(text, kind="http_5xx")
    return Rejected(f"http_{code}" if code else "stream_error", text)


@dataclass
class ServerHealth:
    """One server's rotation state and accounting (03's meta ``servers``)."""

    url: str
    healthy: bool = True
    next_probe: float = 0.0  # monotonic time of the next probe while out of rotation
    level: int = 0  # backoff exponent: times taken out and failed probes since its last answer
    in_a_row: int = 0  # faults and rejections since its last answer
    throttles: int = 0  # HTTP 429s since its last other reply
    cool_until: float = 0.0  # after a 429: no new work before this monotonic time
    out_since: float | None = None
    out_s: float = 0.0  # total seconds out of rotation
    answered: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # summed latency of the answers it gave
    streams: int = 0  # streamed requests in flight on it
    last_token: float = 0.0  # monotonic time of its last new token (or of its first stream's start)
    failures: Counter = field(default_factory=Counter)
    last_error: str = ""

    def available(self, now: float) -> bool:
        """In rotation and not cooling down after a 429: its workers may take new work."""
        return self.healthy and now >= self.cool_until

    def answer(self, n_tokens: int, busy_s: float) -> None:
        self.answered += 1
        self.tokens += n_tokens
        self.busy_s += busy_s
        self.in_a_row = self.throttles = self.level = 0

    def stream_started(self, now: float) -> None:
        if not self.streams:  # idle until now: the stall clock starts with this stream
            self.last_token = now
        self.streams += 1

    def stream_ended(self) -> None:
        self.streams -= 1

    def stalled(self, now: float, stall_s: float) -> bool:
        """Streams in flight and no new token on any of them for `stall_s`."""
        return self.streams > 0 and now - self.last_token > stall_s

    def fault(self, now: float, kind: str, detail: str, delay: float, at_once: bool) -> None:
        """A fault or rejection: counted; out of rotation `at_once` or at IN_A_ROW in a row."""
        self.failures[kind] += 1
        self.last_error = detail[:300]
        self.in_a_row, self.throttles = self.in_a_row + 1, 0
        if at_once or self.in_a_row >= IN_A_ROW:
            self.take_out(now, delay)

    def throttle(self, now: float, detail: str, delay: float) -> None:
        """HTTP 429: no new work for `delay` seconds; still in rotation."""
        self.failures["http_429"] += 1
        self.last_error = detail[:300]
        self.throttles += 1
        self.cool_until = max(self.cool_until, now + delay)

    def take_out(self, now: float, delay: float) -> None:
        if self.healthy:
            self.healthy, self.out_since, self.next_probe = False, now, now + delay
            self.level += 1

    def back(self, now: float) -> None:
        """Its probe passed (the backoff level stays until it answers: a server that fails again at once
        waits longer each time)."""
        if not self.healthy:
            self.out_s += now - (self.out_since or now)
        self.healthy, self.out_since, self.in_a_row = True, None, 0

    def record(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        out = self.out_s + (now - self.out_since if self.out_since is not None else 0.0)
        tps = self.tokens / self.busy_s if self.busy_s else None
        return {"url": self.url, "in_rotation": self.healthy, "answered": self.answered, "tokens": self.tokens,
                "tokens_per_s_per_request": round(tps, 2) if tps else None, "failures": dict(self.failures),
                "seconds_out_of_rotation": round(out, 2), "last_error": self.last_error}  # fmt: skip


def cut_short(text: str) -> bool:
    """Whether a JSON text that does not parse is a document cut off (its HTTP framing complete, its content
    not: a proxy or a dying server ended the body early) rather than garbage: it is empty, or it ends inside an
    open object/array with the parser failing only in its last, unfinished token (a string cut midway is
    closed after its last whole character first)."""
    text = text.rstrip()
    if not text:
        return True
    try:
        json.loads(text)
        return False
    except ValueError as e:
        pos = getattr(e, "pos", -1)
    depth, in_str, esc, hex_left, escape_at, last = 0, False, False, 0, -1, -1
    for i, ch in enumerate(text):
        if in_str:
            if hex_left:  # inside \uXXXX
                hex_left -= 1
            elif esc:
                esc, hex_left = False, 4 if ch == "u" else 0
            elif ch == "\\":
                esc, escape_at = True, i
            elif ch == '"':
                in_str, last = False, i
        elif ch == '"':
            in_str = True
        elif ch in "[{,:]}":
            depth += (ch in "[{") - (ch in "]}")
            last = i
    if in_str:
        return cut_short(text[: escape_at if esc or hex_left else len(text)] + '"')
    return depth > 0 and pos > last and _SCALAR_PREFIX.fullmatch(text[last + 1 :].strip()) is not None


@dataclass
class ErrorBudget:
    """Says when a run's failures are clearly past `fraction` (03's max_error_fraction), long before its end: at
    least `min_failures` failures, and the lower end of the Wilson score interval (z = `z`) of the failure rate
    so far above `fraction`. A run failing at exactly `fraction` trips it with probability ~3e-7 per check
    (z = 5); one whose every request fails trips it at its `min_failures`-th failure."""

    fraction: float
    min_failures: int = 10
    z: float = 5.0
    ok: int = 0
    failed: int = 0
    reasons: Counter = field(default_factory=Counter)

    def add(self, reason: str | None) -> None:
        """One outcome: None for an answer, else the failure's reason."""
        if reason is None:
            self.ok += 1
        else:
            self.failed += 1
            self.reasons[reason] += 1

    def lower_bound(self) -> float:
        n, z = self.ok + self.failed, self.z
        if not n:
            return 0.0
        p = self.failed / n
        centre = p + z * z / (2 * n)
        spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return (centre - spread) / (1 + z * z / n)

    def exceeded(self) -> bool:
        return self.failed >= self.min_failures and self.lower_bound() > self.fraction

    def summary(self) -> str:
        n = self.ok + self.failed
        return (f"{self.failed} of the {n} requests answered or failed so far failed (reasons "
                f"{dict(self.reasons.most_common(3))}; the failure rate is at least {self.lower_bound():.3f} "
                f"at z = {self.z:g}), clearly past max_error_fraction {self.fraction:g}")  # fmt: skip


@dataclass(eq=False)
class WorkItem:
    """A request in the work queue, with what happened to it so far."""

    req: Request
    attempt: int = 0  # retries charged to it
    t0: float | None = None  # monotonic time of its first attempt
    failed_on: frozenset = field(default_factory=frozenset)  # servers whose fault it met
    rejected_on: frozenset = field(default_factory=frozenset)  # servers that rejected it


class WorkQueue:
    """The work queue of one generate(): first in, first out, but a rejected request goes first (its second
    opinion), and each worker takes the first request its server may take (not one it rejected itself while
    another server in rotation has not)."""

    def __init__(self):
        self.items: deque[WorkItem] = deque()
        self.added = asyncio.Event()

    def put(self, it: WorkItem, first: bool = False) -> None:
        (self.items.appendleft if first else self.items.append)(it)
        self.added.set()

    async def take(self, may, timeout_s: float) -> WorkItem | None:
        """The first item `may(item)` accepts; None when there is none within `timeout_s`."""
        for i, it in enumerate(self.items):
            if may(it):
                del self.items[i]
                return it
        self.added.clear()
        try:
            await asyncio.wait_for(self.added.wait(), timeout_s)
        except TimeoutError:
            pass
        return None
