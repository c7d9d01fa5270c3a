"""The write-ahead spool: an acknowledged span is on local disk before the client hears 200.

Requests are written as framed records (magic, length, rows, CRC32, payload) one after
another into the open segment; the magic says what the payload is: an OTLP protobuf request
body as received and checked (:data:`OTLP`, decoded in bulk at flush time) or an Arrow IPC
batch (:data:`ARROW`). Callers return only once their bytes are fsynced (group commit: one
fsync covers every caller waiting at that moment). The open segment is zeroed a stretch ahead
of its write offset (a WAL's practice): a small record then lands inside the file, and its
``fdatasync`` writes the pages without journalling a new file size each time (a commit of four
9-KB records: 205-222 -> 126-163 us of CPU). A segment is sealed by size or age (its zeros cut
off) and handed to the flusher, which deletes it only after the store has the batch. A crash
loses nothing acknowledged: on start the open segment is cut back to its last complete record
(what follows is the zeroed stretch or a record the crash tore) and sealed. Each segment
inserts under its own token (spool id + sequence number), so a segment that was written to the
store just before a crash is not stored twice when it is replayed.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

_HEADER = struct.Struct("<4sIII")  # magic, payload length, rows, crc32(payload)
ARROW = b"TTS1"  #: an Arrow IPC stream of spans in ``otel_traces`` layout
OTLP = b"TTP1"  #: a checked OTLP/protobuf ``ExportTraceServiceRequest`` body
OTLP_EVENTS_LINKS = b"TTP2"  #: the same, with span events or links
_MAGICS = (ARROW, OTLP, OTLP_EVENTS_LINKS)


class SpoolError(RuntimeError):
    pass


@dataclass(frozen=True)
class Segment:
    seq: int
    path: Path
    rows: int
    bytes: int


class _Sealed(dict):
    """The sealed segments by sequence number, with their rows and bytes summed as they come
    and go: the receiver reads the spool's size on every request (its limit), and after an
    outage of the store hundreds of segments wait."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = self.bytes = 0

    def __setitem__(self, seq: int, seg: Segment) -> None:
        self.pop(seq, None)
        super().__setitem__(seq, seg)
        self.rows += seg.rows
        self.bytes += seg.bytes

    def pop(self, seq: int, default=None):  # noqa: D102
        seg = super().pop(seq, None)
        if seg is None:
            return default
        self.rows -= seg.rows
        self.bytes -= seg.bytes
        return seg

    def __delitem__(self, seq: int) -> None:
        if self.pop(seq) is None:
            raise KeyError(seq)


def _scan(path: Path, into: bytearray | None = None) -> tuple[int, int, list[tuple[bytes, memoryview]], bool]:
    """(valid bytes, rows, (magic, payload) records, torn tail?) of a segment file; payloads
    are views of one read of the file (a flush of 200k spans copied 50 MB twice more), read
    ``into`` a buffer big enough when one is given."""
    if into is None:
        data = memoryview(path.read_bytes())
    else:
        with open(path, "rb") as f:
            data = memoryview(into)[: f.readinto(memoryview(into))]
    pos = rows = 0
    payloads: list[tuple[bytes, memoryview]] = []
    while pos + _HEADER.size <= len(data):
        magic, length, nrows, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if magic not in _MAGICS or end > len(data):
            break
        payload = data[pos + _HEADER.size : end]
        if zlib.crc32(payload) != crc:
            break
        payloads.append((magic, payload))
        rows += nrows
        pos = end
    # a segment written ahead with zeros ends in zeros after its last record: not a torn one
    torn = pos != len(data) and data[pos:] != bytes(len(data) - pos)
    return pos, rows, payloads, torn


class Spool:
    """See the module docstring. One collector process owns a spool directory."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        segment_bytes: int = 8 * 1024 * 1024,
        segment_age_s: float = 0.5,
        fsync: bool = True,
        zero_ahead_bytes: int = 256 << 10,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.segment_age_s = segment_age_s
        self.fsync = fsync
        # records smaller than this are written into zeros laid down ahead of them (fsync on)
        self.zero_ahead_bytes = zero_ahead_bytes if fsync else 0
        self._lock_fd = os.open(self.dir / "spool.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SpoolError(
                f"spool {self.dir} is in use by another collector; give this one its own --spool"
            ) from None
        self._lock = threading.Lock()  # guards the open segment
        self._sync_lock = threading.Lock()  # one fsync at a time
        self._sealed = _Sealed()
        self.torn_records_dropped = 0
        self._recover()
        self.id = self._spool_id()
        self._seq = max(self._sealed, default=0) + 1
        self._fd: int | None = None
        self._open_seq = 0
        self._open_rows = 0
        self._open_bytes = 0
        self._open_since = 0.0
        self._zeroed = 0  # the open segment's file is zeros from _open_bytes up to here
        self._zeros: bytes | None = None  # what is written ahead, allocated on first use
        self._synced = (0, 0)  # (seq, bytes) known durable
        self._read_buf: bytearray | None = None  # records() reads segments into it

    # ---------------------------------------------------------------- recovery
    def _spool_id(self) -> str:
        """The token prefix of this spool's segments.

        Sequence numbers restart at 1 when the spool is empty, so an empty spool takes a new
        id: ``{id}-{seq}`` must never repeat a token the store already remembers (its
        deduplication window would silently skip the new batch). Left-over segments keep
        the old id, so their replay after a crash is still recognised as a duplicate; the
        segments that follow them continue the numbering above the highest one left.
        """
        id_file = self.dir / "spool.id"
        if self._sealed and id_file.exists():
            return id_file.read_text().strip()
        new = uuid.uuid4().hex
        tmp = self.dir / f".spool.id.{new}.tmp"
        with open(tmp, "w") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, id_file)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return new

    def _recover(self) -> None:
        for p in sorted(self.dir.glob("*.open")):
            seq = int(p.stem)
            valid, rows, _, torn = _scan(p)
            if torn:  # a record cut by a crash was never acknowledged
                self.torn_records_dropped += 1
            if valid != p.stat().st_size:  # the torn record, or the zeroed stretch ahead
                with open(p, "r+b") as f:
                    f.truncate(valid)
                    os.fsync(f.fileno())
            if valid == 0:
                p.unlink()
                continue
            sealed = p.with_suffix(".sealed")
            os.replace(p, sealed)
            self._sealed[seq] = Segment(seq, sealed, rows, valid)
        for p in sorted(self.dir.glob("*.sealed")):
            seq = int(p.stem)
            if seq not in self._sealed:
                valid, rows, _, _ = _scan(p)
                self._sealed[seq] = Segment(seq, p, rows, valid)

    # ------------------------------------------------------------------ writes
    def append(self, payload: bytes, rows: int, kind: bytes = ARROW) -> bool:
        """Append one record of ``kind`` (:data:`ARROW`, :data:`OTLP`, :data:`OTLP_EVENTS_LINKS`); returns once it is
        durable (fsynced, unless disabled). True when this record opened a new segment (the
        flusher's next deadline changed)."""
        opened, mark = self.write(payload, rows, kind)
        self.sync(mark)
        return opened

    def write(self, payload: bytes, rows: int, kind: bytes = ARROW) -> tuple[bool, tuple[int, int]]:
        """Append one record without waiting for the disk: (opened a new segment?, the mark
        :meth:`sync` takes). Nothing written so is durable, nor may be acknowledged, before
        a ``sync`` of its mark (or of a later one) returns."""
        if kind not in _MAGICS:
            raise ValueError(f"unknown spool record kind {kind!r}")
        header = _HEADER.pack(kind, len(payload), rows, zlib.crc32(payload))
        size = len(header) + len(payload)
        with self._lock:
            opened = self._fd is None
            if opened:
                self._open_seq = self._seq
                self._seq += 1
                path = self.dir / f"{self._open_seq:016d}.open"
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                self._open_rows = self._open_bytes = self._zeroed = 0
                self._open_since = time.monotonic()
            at = self._open_bytes
            if at + size > self._zeroed and size < self.zero_ahead_bytes:
                self._zero_ahead_locked(at, at + size)  # first: a failure leaves no record behind
            n = os.pwritev(self._fd, (header, payload), at)  # no copy of the payload into a frame
            if n != size:  # pragma: no cover - disk full mid-write
                raise SpoolError("short write to the spool (disk full?)")
            self._open_rows += rows
            self._open_bytes += size
            me = (self._open_seq, self._open_bytes)
            if self._open_bytes >= self.segment_bytes:
                self._seal_locked()
        return opened, me

    def _zero_ahead_locked(self, at: int, end: int) -> None:
        """Zeros from ``at`` (or where the zeros already reach) to a stretch past ``end``, the
        end of the record about to be written at ``at``: the next small records overwrite
        them and their syncs leave the file's size alone (one size change per stretch, not per
        record). A large record just extends the file: its one size change is worth its bytes."""
        stretch = self.zero_ahead_bytes
        if self._zeros is None:
            self._zeros = bytes(2 * stretch)
        start = max(self._zeroed, at)
        todo = end + stretch - start  # < 2 stretches: the record itself is smaller than one
        n = os.pwrite(self._fd, memoryview(self._zeros)[:todo], start)
        if n != todo:  # pragma: no cover - disk full: the records so far are whole
            raise SpoolError("short write to the spool (disk full?)")
        self._zeroed = end + stretch

    def sync(self, mark: tuple[int, int]) -> None:
        """Return once every record up to ``mark`` is on disk (group commit: one fdatasync
        covers every record written before it; a no-op with fsync off)."""
        if self.fsync:
            self._sync(mark)

    def _sync(self, me: tuple[int, int]) -> None:
        with self._sync_lock:
            if self._synced >= me:
                return  # someone else's fsync already covered this record
            with self._lock:
                if self._fd is None or self._open_seq != me[0]:
                    return  # sealed meanwhile; sealing fsyncs
                fd = os.dup(self._fd)
                target = (self._open_seq, self._open_bytes)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self._synced = max(self._synced, target)

    def _seal_locked(self) -> None:
        if self._fd is None:
            return
        if self._zeroed > self._open_bytes:
            os.ftruncate(self._fd, self._open_bytes)  # the zeros ahead are not records
        if self.fsync:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        src = self.dir / f"{self._open_seq:016d}.open"
        dst = src.with_suffix(".sealed")
        os.replace(src, dst)
        self._sealed[self._open_seq] = Segment(self._open_seq, dst, self._open_rows, self._open_bytes)
        self._synced = max(self._synced, (self._open_seq, self._open_bytes))

    def due_in_s(self) -> float | None:
        """Seconds until the open segment is due for sealing; None when none is open."""
        with self._lock:
            if self._fd is None:
                return None
            return max(self._open_since + self.segment_age_s - time.monotonic(), 0.0)

    def seal(self, *, only_if_due: bool = False) -> None:
        with self._lock:
            if self._fd is None:
                return
            if only_if_due and time.monotonic() - self._open_since < self.segment_age_s:
                return
            self._seal_locked()

    # ------------------------------------------------------------------- reads
    def sealed(self) -> list[Segment]:
        with self._lock:
            return [self._sealed[k] for k in sorted(self._sealed)]

    @staticmethod
    def read(seg: Segment) -> list[bytes]:
        """The payloads of a segment, in order."""
        return [bytes(p) for _, p in _scan(seg.path)[2]]

    def records(self, seg: Segment) -> list[tuple[bytes, memoryview]]:
        """The (kind, payload) records of a segment, in order. The payloads are views of a
        buffer this spool reuses for the next segment's records (a fresh 50 MB read costs a
        page fault per 4 KiB): use them before asking for the next segment's."""
        size = seg.path.stat().st_size
        if self._read_buf is None or len(self._read_buf) < size:
            self._read_buf = bytearray(size + size // 4)  # a new one: views of the last may live on
        return _scan(seg.path, self._read_buf)[2]

    def remove(self, seg: Segment) -> None:
        with self._lock:
            self._sealed.pop(seg.seq, None)
        seg.path.unlink(missing_ok=True)

    def token(self, seg: Segment) -> str:
        return f"{self.id}-{seg.seq}"

    @property
    def pending_rows(self) -> int:
        with self._lock:
            return self._sealed.rows + (self._open_rows if self._fd else 0)

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._sealed.bytes + (self._open_bytes if self._fd else 0)

    def close(self) -> None:
        with self._lock:
            self._seal_locked()
        os.close(self._lock_fd)
