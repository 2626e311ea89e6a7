"""The run journal: every model call of one run, appended to disk as it happens.

Why not one record per call holding its full prompt: a call's prompt is nearly always an
earlier call's prompt + output + tool text, so a run of hundreds of calls over a growing
context would write calls x context tokens (quadratic; ~700 MB as JSON for 400 calls at
600K tokens). Here a call record names the earlier call whose ``prompt + output`` its
prompt extends (``base``) and how many leading tokens they share (``shared``), and stores
only the rest: the journal grows with the run's unique tokens.

Format 2, binary, little-endian:
  magic ``MAGIC`` (8 bytes), then records, each
    header  <I length> <I payload crc32> <B type> <I header crc32 (of the 9 bytes before)>
    payload ``length`` bytes
  type 1 run   JSON {"run_id", "task_id", "format": 2}                first record
  type 2 call  <i base> <i shared> <i n_new> <i n_out> <i policy_version> <B role> <H agent bytes>
               agent (utf-8), new prompt tokens int32[n_new], output int32[n_out], logprobs float32[n_out]
  type 3 end   JSON {"status", "reward", "wall_s", "passed"}           last record, once
Each record is written and ``fsync``'d before the harness acts on the call. A crash tears
at most the last record: a short header, a payload cut short, or (the data blocks of a
grown file not yet written) a last record whose payload checksum fails; load ignores such
a tail and counts its bytes, ``reopen`` cuts it. Damage anywhere else is an error naming
the file, the record and its byte offset: nothing is skipped silently. Logprobs are stored
as float32, the dtype the engines produce, so they round-trip exactly.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gyre_hpc import fsio
from gyre_hpc.trees.calls import CallIncrement, CallLog
from gyre_hpc.trees.model import ROLE_CODE, ROLES, STATUSES, ModelCall

FORMAT = 2
MAGIC = b"\x89GYREJ2\n"
_HEADER = struct.Struct("<IIBI")
_CALL = struct.Struct("<iiiiiBH")
RUN, CALL, END = 1, 2, 3


class JournalError(ValueError):
    """A journal that cannot be trusted; the message names the file and record."""


@dataclass
class JournalState:
    path: Path
    run_id: str
    task_id: str
    calls: CallLog = field(default_factory=CallLog)   # whole calls by index, increments held
    status: str = "running"       # "running" (no end record yet) or one of STATUSES
    reward: float | None = None
    wall_s: float | None = None
    passed: list[bool] | None = None
    torn_bytes: int = 0           # bytes of a torn last record that load ignored

    @property
    def finished(self) -> bool:
        return self.status != "running"


def _frame(kind: int, payload: bytes) -> bytes:
    head = struct.pack("<IIB", len(payload), zlib.crc32(payload), kind)
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def _records(p: Path, raw: bytes):
    """(index, offset, type, payload) of each whole record; the torn tail's size last."""
    at, n = len(MAGIC), 0
    while at < len(raw):
        n += 1
        if len(raw) - at < _HEADER.size:
            return at
        length, crc, kind, head_crc = _HEADER.unpack_from(raw, at)
        if zlib.crc32(raw[at:at + 9]) != head_crc:
            if not any(raw[at:]):
                return at  # a grown file whose data never reached the disk: zeros to the end
            raise JournalError(f"journal {p} record {n} (byte {at}) is damaged: bad header checksum; "
                               f"only the last record may be torn")
        end = at + _HEADER.size + length
        if end > len(raw):
            return at
        payload = raw[at + _HEADER.size:end]
        if zlib.crc32(payload) != crc:
            if end == len(raw):
                return at
            raise JournalError(f"journal {p} record {n} (byte {at}) is damaged: bad payload checksum; "
                               f"only the last record may be torn")
        yield n, at, kind, payload
        at = end
    return at


def _json(p: Path, n: int, payload: bytes) -> dict:
    try:
        rec = json.loads(payload)
    except ValueError as exc:
        raise JournalError(f"journal {p} record {n}: bad JSON payload ({exc})") from None
    if not isinstance(rec, dict):
        raise JournalError(f"journal {p} record {n}: payload is not a JSON object")
    return rec


class _CallDecoder:
    """Rebuilds calls as the increments they were written as (``trees.calls``): a loaded run
    holds its unique tokens once, as the live harness does."""

    def __init__(self, p: Path, log: CallLog):
        self.p = p
        self.log = log

    def decode(self, n: int, payload: bytes) -> CallIncrement:
        p = self.p
        if len(payload) < _CALL.size:
            raise JournalError(f"journal {p} record {n}: call record of {len(payload)} bytes is too short")
        base, shared, n_new, n_out, version, role, agent_len = _CALL.unpack_from(payload)
        at = _CALL.size
        if min(n_new, n_out, agent_len) < 0 or len(payload) != at + agent_len + 4 * n_new + 8 * n_out:
            raise JournalError(f"journal {p} record {n}: bad call record (sizes do not add up)")
        if role >= len(ROLES):
            raise JournalError(f"journal {p} record {n}: bad call record (role code {role}; roles are {ROLES})")
        if not -1 <= base < len(self.log):
            raise JournalError(f"journal {p} record {n}: bad call record (base call {base} of {len(self.log)})")
        if base >= 0 and not 0 <= shared <= self.log.seq_len(base) or base < 0 and shared != 0:
            raise JournalError(f"journal {p} record {n}: bad call record (shares {shared} tokens with call {base})")
        agent = payload[at:at + agent_len].decode("utf-8", errors="replace")
        at += agent_len
        new = np.frombuffer(payload, np.int32, n_new, at).copy()
        out = np.frombuffer(payload, np.int32, n_out, at + 4 * n_new).copy()
        logprobs = np.frombuffer(payload, np.float32, n_out, at + 4 * (n_new + n_out)).copy()
        return CallIncrement(base, shared, new, out, logprobs, role=ROLES[role], agent=agent, policy_version=version)


def load_journal(path: str | Path) -> JournalState:
    """Read a journal; a torn last record is skipped (and counted), any other damage is an error."""
    p = Path(path)
    if not p.is_file():
        raise JournalError(f"journal {p} does not exist")
    raw = p.read_bytes()
    if raw[:1] == b"{":
        raise JournalError(
            f"journal {p} is in the old JSON-lines format (format 1); this version reads format {FORMAT} "
            f"(binary, shared contexts) only: finish or discard that run with the version that wrote it")
    if raw[:len(MAGIC)] != MAGIC:
        if MAGIC.startswith(raw):
            raise JournalError(f"journal {p} does not start with a run record (the file is {len(raw)} bytes)")
        raise JournalError(f"journal {p} is not a gyre journal (no format-{FORMAT} magic at its start)")
    records = _records(p, raw)
    decoder = _CallDecoder(p, CallLog())     # its log becomes the state's calls
    state: JournalState | None = None
    while True:
        try:
            n, at, kind, payload = next(records)
        except StopIteration as stop:
            tail = len(raw) - stop.value
            break
        if state is None:
            if kind != RUN:
                raise JournalError(f"journal {p} does not start with a run record")
            head = _json(p, n, payload)
            state = JournalState(p, str(head.get("run_id", "")), str(head.get("task_id", "")), decoder.log)
            continue
        if state.finished:
            raise JournalError(f"journal {p} record {n} (byte {at}): a record after the end record")
        if kind == CALL:
            state.calls.append(decoder.decode(n, payload))
        elif kind == END:
            rec = _json(p, n, payload)
            if rec.get("status") not in STATUSES:
                raise JournalError(f"journal {p} record {n}: status {rec.get('status')!r} is not one of {STATUSES}")
            state.status = rec["status"]
            state.reward = float(rec["reward"])
            state.wall_s = float(rec["wall_s"])
            state.passed = list(rec.get("passed") or [])
        elif kind == RUN:
            raise JournalError(f"journal {p} record {n} (byte {at}): a second run record")
        else:
            raise JournalError(f"journal {p} record {n} (byte {at}): unknown record type {kind}")
    if state is None:
        raise JournalError(f"journal {p} does not start with a run record")
    state.torn_bytes = tail
    return state


class JournalWriter:
    """Appends records with fsync. ``create`` starts a journal, ``reopen`` continues an unfinished one.

    ``append`` writes a call the harness gives as an increment (it knows each prompt's origin:
    O(new tokens), however long the context); ``append_call`` takes a whole call and finds its
    base among the likely earlier calls (the agent's previous call and the 8 before it)."""

    def __init__(self, path: Path, fh, log: CallLog | None = None) -> None:
        self.path = path
        self._fh = fh
        self.log = log if log is not None else CallLog()   # what the file holds, for append_call's search

    @classmethod
    def create(cls, path: str | Path, run_id: str, task_id: str) -> "JournalWriter":
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        w = cls(p, open(p, "wb"))
        w._fh.write(MAGIC)
        w._append(RUN, json.dumps({"run_id": run_id, "task_id": task_id, "format": FORMAT}).encode())
        fsio.sync_path(p.parent)   # the new file's name, or power loss could lose the whole journal
        return w

    @classmethod
    def reopen(cls, state: JournalState) -> "JournalWriter":
        """Continue an unfinished journal: cut its torn tail first so appends start on a record."""
        if state.finished:
            raise JournalError(f"journal {state.path} already ended with status {state.status!r}")
        fh = open(state.path, "r+b")
        if state.torn_bytes:
            fh.truncate(os.path.getsize(state.path) - state.torn_bytes)
        fh.seek(0, os.SEEK_END)
        return cls(state.path, fh, CallLog(state.calls.increments))

    def _append(self, kind: int, payload: bytes) -> None:
        with fsio.naming_full_disk(self.path):
            self._fh.write(_frame(kind, payload))
            fsio.sync_file(self._fh)

    def append(self, inc: CallIncrement) -> None:
        """Write one call given as an increment (its base must be an earlier call of this journal)."""
        k = len(self.log)
        if not -1 <= inc.base < k or inc.base >= 0 and inc.shared > self.log.seq_len(inc.base):
            raise ValueError(f"journal {self.path}: call {k} shares {inc.shared} tokens with call {inc.base}, "
                             f"which the journal does not hold")
        agent = inc.agent.encode()
        head = _CALL.pack(inc.base, inc.shared, inc.new.size, inc.output.size, inc.policy_version,
                          ROLE_CODE[inc.role], len(agent))
        self._append(CALL, b"".join([head, agent, np.ascontiguousarray(inc.new, "<i4").tobytes(),
                                     np.ascontiguousarray(inc.output, "<i4").tobytes(),
                                     np.ascontiguousarray(inc.logprobs, "<f4").tobytes()]))
        self.log.append(inc)

    def append_call(self, call: ModelCall) -> None:
        self.append(self.log.increment_for(call))

    def end(self, status: str, reward: float, wall_s: float, passed: list[bool]) -> None:
        if status not in STATUSES:
            raise ValueError(f"status {status!r}: valid statuses are {', '.join(STATUSES)}")
        self._append(END, json.dumps({"status": status, "reward": float(reward), "wall_s": float(wall_s),
                                      "passed": [bool(x) for x in passed]}).encode())
        self.close()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
