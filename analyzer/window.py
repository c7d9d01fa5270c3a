"""The slice of data an analysis looks at: a time window plus optional filters.

Filters always reach SQL as bound parameters (``{name:Type}``), never as text.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from ttftscope.schemas.vocabulary import Attr, ResourceAttr

_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'15m' -> 900.0 seconds."""
    m = _DUR.match(text or "")
    if not m:
        raise ValueError(f"invalid duration {text!r}: use e.g. 90s, 15m, 2h, 7d")
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_time(text: str, now: float | None = None) -> int:
    """An absolute time (ISO 8601, or epoch seconds) or 'now-15m' -> ns since epoch."""
    import datetime as dt

    now = time.time() if now is None else now
    t = (text or "").strip()
    if t == "now":
        return int(now * 1e9)
    if t.startswith("now-"):
        return int((now - parse_duration(t[4:])) * 1e9)
    try:
        return int(float(t) * 1e9)
    except ValueError:
        pass
    try:
        d = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"invalid time {text!r}: use ISO 8601 (2026-11-29T07:00:00Z), epoch seconds or now-15m") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.timezone.utc)
    return int(d.timestamp() * 1e9)


@dataclass(frozen=True)
class Window:
    since_ns: int
    until_ns: int
    model: str | None = None
    version: str | None = None  # service.version
    run: str | None = None  # ttftscope.run resource attribute

    def __post_init__(self) -> None:
        if self.until_ns <= self.since_ns:
            raise ValueError("the window is empty: --until must be after --since")

    @classmethod
    def last(cls, seconds: float = 3600, **kw) -> Window:
        now = time.time_ns()
        return cls(now - int(seconds * 1e9), now + 10**9, **kw)

    def params(self) -> dict:
        return {"since": self.since_ns, "until": self.until_ns, "model": self.model or "",
                "version": self.version or "", "run": self.run or ""}

    @staticmethod
    def time_filter(slack_before_s: int = 0, slack_after_s: int = 0, col: str = "Timestamp") -> str:
        return (f"{col} >= fromUnixTimestamp64Nano(toInt64({{since:Int64}} - {int(slack_before_s * 1e9)})) "
                f"AND {col} < fromUnixTimestamp64Nano(toInt64({{until:Int64}} + {int(slack_after_s * 1e9)}))")

    @staticmethod
    def request_filter() -> str:
        """Filters on the request (``llm_request``) span."""
        return (f"({{model:String}} = '' OR SpanAttributes['{Attr.MODEL}'] = {{model:String}} "
                f"OR ResourceAttributes['{ResourceAttr.MODEL}'] = {{model:String}}) "
                f"AND ({{version:String}} = '' OR ResourceAttributes['{ResourceAttr.SERVICE_VERSION}'] = {{version:String}}) "
                f"AND ({{run:String}} = '' OR ResourceAttributes['{ResourceAttr.RUN}'] = {{run:String}})")

    def describe(self) -> dict:
        import datetime as dt

        def iso(ns: int) -> str:
            return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds")

        d = {"since": iso(self.since_ns), "until": iso(self.until_ns)}
        for k in ("model", "version", "run"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        return d
