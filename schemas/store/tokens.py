"""The embedded store's insert-token window, kept as runs of consecutive spool sequence numbers.

The store remembers the last ``window`` insert tokens (like ClickHouse's
``non_replicated_deduplication_window``) so that a spool segment replayed after a crash is not
stored twice. A collector's tokens are ``{spool id}-{segment number}``, one a flush, numbered
1, 2, 3 ...: kept one by one, a window of 10,000 was ~600 KB of JSON in the manifest, read,
written and fsynced on every flush of a collector that had run for six hours (and from then on
for good: ~300 KB/s of disk writes at a 2-s flush). As runs it is one entry a spool id:
``[prefix, first, last, t_first, t_last]`` covers the tokens ``prefix-first`` ...
``prefix-last``, inserted from ``t_first`` to ``t_last``. A token not of that form (no
``-<number>`` suffix, or one with leading zeros) is an entry of its own, as before: ``[token, t]``.

Past the window the oldest tokens are forgotten first: the run whose first token is the oldest
gives it up (the run's new first token's time is interpolated over the run). With one writer that
is exactly the last ``window`` tokens; with several writers committing in turn each run is
extended where it is, so the order across runs is by time, not by commit.
"""

from __future__ import annotations

import re

#: a run's fields (an entry of five); a token of no spool form is an entry of two: ``[token, time]``
PREFIX, FIRST, LAST, T_FIRST, T_LAST = range(5)
_SEQ = re.compile(r"^(.+)-(0|[1-9][0-9]{0,17})$")


def _split(token: str) -> tuple[str, int]:
    m = _SEQ.match(token)
    return (m.group(1), int(m.group(2))) if m else (token, -1)


def _n(r: list) -> int:
    return r[LAST] - r[FIRST] + 1 if len(r) == 5 else 1


def size(runs: list[list]) -> int:
    """How many tokens the runs hold."""
    return sum(_n(r) for r in runs)


def contains(runs: list[list], token: str) -> bool:
    prefix, seq = _split(token)
    if seq < 0:
        return any(len(r) == 2 and r[0] == token for r in runs)
    return any(len(r) == 5 and r[PREFIX] == prefix and r[FIRST] <= seq <= r[LAST] for r in runs)


def add(runs: list[list], token: str, now: float, window: int) -> None:
    """Remember ``token`` (inserted at ``now``), in place; then forget the oldest past ``window``."""
    from_pairs(((token, now),), window, runs)


def trim(runs: list[list], window: int) -> None:
    """Forget the oldest tokens until at most ``window`` are held, in place: whole entries by the
    time of their first token, oldest first, then the first tokens of the run that straddles."""
    over = size(runs) - max(window, 0)
    if over <= 0:
        return
    gone = set()
    for i in sorted(range(len(runs)), key=lambda k: runs[k][T_FIRST] if len(runs[k]) == 5 else runs[k][1]):
        r = runs[i]
        n = _n(r)
        if n <= over:
            gone.add(i)
            over -= n
        else:
            r[T_FIRST] += (r[T_LAST] - r[T_FIRST]) / (n - 1) * over
            r[FIRST] += over
            over = 0
        if over == 0:
            break
    if gone:
        runs[:] = [r for i, r in enumerate(runs) if i not in gone]


def from_pairs(pairs, window: int, runs: list[list] | None = None) -> list[list]:
    """Runs from ``[token, time]`` pairs, oldest first (one insert's token; the manifest's form
    before runs, and what a lost manifest is rebuilt from), added after ``runs`` in one pass and
    trimmed once: a spool id's latest run extends when the number follows on."""
    runs = [] if runs is None else runs
    latest = {r[PREFIX]: r for r in runs if len(r) == 5}  # a spool id's latest run
    for token, t in pairs:
        token, t = str(token), float(t)
        prefix, seq = _split(token)
        if seq < 0:
            runs.append([token, t])
            continue
        r = latest.get(prefix)
        if r is not None and r[LAST] + 1 == seq:
            r[LAST], r[T_LAST] = seq, t
        else:
            latest[prefix] = r = [prefix, seq, seq, t, t]
            runs.append(r)
    trim(runs, window)
    return runs


def tokens(runs: list[list]) -> list[str]:
    """Every token the runs hold (for checks and tests; a window's worth)."""
    return [r[0] if len(r) == 2 else f"{r[PREFIX]}-{s}" for r in runs
            for s in (range(r[FIRST], r[LAST] + 1) if len(r) == 5 else (0,))]


def valid(runs) -> bool:
    """Whether ``runs`` is a list of well-formed entries (a manifest's ``token_runs``)."""
    if not isinstance(runs, list):
        return False
    num = (int, float)
    for r in runs:
        if not isinstance(r, list) or not r or not isinstance(r[0], str):
            return False
        if len(r) == 2:
            if not isinstance(r[1], num):
                return False
        elif not (len(r) == 5 and isinstance(r[FIRST], int) and isinstance(r[LAST], int) and 0 <= r[FIRST] <= r[LAST]
                  and isinstance(r[T_FIRST], num) and isinstance(r[T_LAST], num)):
            return False
    return True
