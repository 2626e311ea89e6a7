"""What ``trees.zarr`` holds: its dimensions, arrays, chunk layout, and the pure mapping
between ``Tree`` objects and the flat per-dimension columns the store appends.

Why flat 1-D arrays on named dimensions: a notebook opens the store with
``xarray.open_zarr`` and gets one Dataset (dims ``tree``, ``token``, ``node``, ``call``,
``dropped``) with no custom reader. Cross-references (``node_start``, ``parent``,
``call_node``) are stored as *absolute* indices into the referenced dimension so such a
notebook can follow them without adding per-tree offsets; ``Tree`` keeps tree-local
indices, and the conversion lives here, in one place. The back-references to dim ``tree``
are ``node_tree``/``call_tree``/``dropped_tree``: a variable named ``tree`` on dim ``node``
would collide with the dimension name in xarray.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from gyre_hpc.trees.model import ROLES, STATUSES, Tree

# Bump when an array is added, removed or changes meaning. Writers write SCHEMA_VERSION;
# readers read every version in READ_VERSIONS (an array's ``since`` says where it starts).
# 2: dim ``sample`` (every sampling event with its own behaviour logprob) and ``multiplicity``.
SCHEMA_VERSION = 2
READ_VERSIONS = (1, 2)
DIMS = ("tree", "token", "node", "call", "dropped", "sample")
_DIM_SINCE = {"sample": 2}


class InvalidTreeError(ValueError):
    """A tree handed to ``append`` that the store cannot hold; names the tree and field."""


@dataclass(frozen=True)
class ArraySpec:
    name: str
    dim: str
    dtype: str          # numpy dtype string, or "str" for variable-length UTF-8
    doc: str
    codes: tuple[str, ...] | None = None   # small-int arrays: code -> label table
    since: int = 1                          # first schema version holding the array


ARRAYS: tuple[ArraySpec, ...] = (
    ArraySpec("tokens", "token", "int32", "token ids, depth-first over each tree's nodes"),
    ArraySpec("logprobs", "token", "float32", "behaviour logprob where trained, 0 elsewhere"),
    ArraySpec("trained", "token", "bool", "True exactly once per policy-sampled token"),
    ArraySpec("node_start", "node", "int64", "absolute index into dim token of the node's first token"),
    ArraySpec("node_len", "node", "int32", "tokens in the node"),
    ArraySpec("parent", "node", "int64", "absolute index into dim node of the parent, -1 for a root"),
    ArraySpec("role", "node", "int8", "role of the call that first created the node", ROLES),
    ArraySpec("node_tree", "node", "int64", "index into dim tree"),
    ArraySpec("call_node", "call", "int64", "absolute index into dim node where the call's path ends"),
    ArraySpec("call_role", "call", "int8", "role of the call", ROLES),
    ArraySpec("call_agent", "call", "str", "agent that made the call (main or a sub-agent id)"),
    ArraySpec("call_tree", "call", "int64", "index into dim tree"),
    ArraySpec("dropped_call", "dropped", "int32", "journal index of a call admission left out"),
    ArraySpec("dropped_tree", "dropped", "int64", "index into dim tree"),
    ArraySpec("run_id", "tree", "str", "agent run id"),
    ArraySpec("task_id", "tree", "str", "task id (the advantage group)"),
    ArraySpec("reward", "tree", "float64", "checker score in [0, 1]"),
    ArraySpec("status", "tree", "str", f"one of {', '.join(STATUSES)}"),
    ArraySpec("policy_version", "tree", "int64", "policy version the run was sampled with"),
    ArraySpec("n_paths", "tree", "int32", "calls (paths) kept in the tree; rows in dim call"),
    ArraySpec("wall_s", "tree", "float64", "wall-clock seconds of the run"),
    ArraySpec("token_offset", "tree", "int64", "first row in dim token"),
    ArraySpec("n_tokens", "tree", "int64", "rows in dim token"),
    ArraySpec("node_offset", "tree", "int64", "first row in dim node"),
    ArraySpec("n_nodes", "tree", "int64", "rows in dim node"),
    ArraySpec("call_offset", "tree", "int64", "first row in dim call"),
    ArraySpec("dropped_offset", "tree", "int64", "first row in dim dropped"),
    ArraySpec("n_dropped", "tree", "int64", "rows in dim dropped"),
    ArraySpec("multiplicity", "token", "int32", "calls that sampled the token (0: context)", since=2),
    ArraySpec("sample_token", "sample", "int64", "absolute index into dim token of the sampled token", since=2),
    ArraySpec("sample_logprob", "sample", "float32", "behaviour logprob of that sampling call", since=2),
    ArraySpec("sample_call", "sample", "int32", "journal index of the call that sampled it (-1 unknown)", since=2),
    ArraySpec("sample_tree", "sample", "int64", "index into dim tree", since=2),
    ArraySpec("sample_offset", "tree", "int64", "first row in dim sample", since=2),
    ArraySpec("n_samples", "tree", "int64", "rows in dim sample", since=2),
)
SPECS = {s.name: s for s in ARRAYS}


def arrays_of(version: int) -> tuple[ArraySpec, ...]:
    """The arrays a store of schema ``version`` holds."""
    return tuple(s for s in ARRAYS if s.since <= version)


def dims_of(version: int) -> tuple[str, ...]:
    return tuple(d for d in DIMS if _DIM_SINCE.get(d, 1) <= version)


@dataclass(frozen=True)
class StoreLayout:
    """Chunk sizes (elements) per dimension and compression, fixed when a store is created.

    A chunk is one file; each append rewrites at most the trailing partial chunk of each
    array, so larger chunks mean fewer files (parallel file systems care) but more bytes
    rewritten per append. The defaults keep a token chunk at 1 MiB of int32.
    """

    token_chunk: int = 1 << 18
    node_chunk: int = 1 << 14
    call_chunk: int = 1 << 14
    dropped_chunk: int = 1 << 12
    sample_chunk: int = 1 << 18   # schema 2; a schema-1 layout reads with the default
    tree_chunk: int = 1 << 12
    zstd_level: int = 1     # 0 stores chunks uncompressed (crc32c still guards them)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"StoreLayout.{f.name}={value!r}: expected an int")
            low = 0 if f.name == "zstd_level" else 1
            if value < low or (f.name == "zstd_level" and value > 22):
                raise ValueError(f"StoreLayout.{f.name}={value}: valid range is {low}..{22 if low == 0 else 'inf'}")

    def chunk(self, dim: str) -> int:
        return getattr(self, f"{dim}_chunk")

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, source: str) -> "StoreLayout":
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: bad store layout {data!r}: {exc}") from None


def canonical_bytes(values: np.ndarray, spec: ArraySpec) -> bytes:
    """Bytes the commit marker's checksums are taken over: little-endian values, and for
    strings a 4-byte length before each UTF-8 string so concatenation stays unambiguous
    (checksums are extended chunk piece by chunk piece, so the encoding must concatenate)."""
    if spec.dtype == "str":
        out = bytearray()
        for s in values.tolist():
            b = str(s).encode("utf-8")
            out += len(b).to_bytes(4, "little")
            out += b
        return bytes(out)
    return np.ascontiguousarray(values, dtype=np.dtype(spec.dtype).newbyteorder("<")).tobytes()


def _as_int(values, dtype: str, where: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise InvalidTreeError(f"{where}: expected a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iub":
        raise InvalidTreeError(f"{where}: expected integers, got dtype {arr.dtype}")
    out = arr.astype(dtype)
    if arr.size and not np.array_equal(out, arr):
        raise InvalidTreeError(f"{where}: values do not fit {dtype}")
    return out


def validate_tree(tree: Tree, where: str) -> None:
    """The invariants the store relies on to slice a tree back out; raises naming the field.

    Checked before anything is written, so a bad tree never leaves half an append behind.
    """
    if not isinstance(tree, Tree):
        raise InvalidTreeError(f"{where}: expected a Tree, got {type(tree).__name__}")
    t = _as_int(tree.tokens, "int32", f"{where}.tokens").size
    for name in ("logprobs", "trained"):
        arr = np.asarray(getattr(tree, name))
        if arr.shape != (t,):
            raise InvalidTreeError(f"{where}.{name}: shape {arr.shape}, expected ({t},) like tokens")
    if not np.all(np.isfinite(np.asarray(tree.logprobs, dtype=np.float64))):
        raise InvalidTreeError(f"{where}.logprobs: contains NaN or inf")
    start = _as_int(tree.node_start, "int64", f"{where}.node_start")
    n = start.size
    length = _as_int(tree.node_len, "int32", f"{where}.node_len")
    parent = _as_int(tree.parent, "int32", f"{where}.parent")
    role = _as_int(tree.node_role, "int8", f"{where}.node_role")
    for name, arr in (("node_len", length), ("parent", parent), ("node_role", role)):
        if arr.size != n:
            raise InvalidTreeError(f"{where}.{name}: {arr.size} values for {n} nodes (node_start)")
    if n:
        bad = np.flatnonzero((start < 0) | (length < 0) | (start + length > t))
        if bad.size:
            i = int(bad[0])
            raise InvalidTreeError(
                f"{where}.node_start/node_len: node {i} spans [{start[i]}, {start[i] + length[i]}) "
                f"outside the tree's {t} tokens")
        bad = np.flatnonzero((parent < -1) | (parent >= np.arange(n)))
        if bad.size:
            i = int(bad[0])
            raise InvalidTreeError(f"{where}.parent[{i}]={parent[i]}: must be -1 or a node before {i}")
        _check_codes(role, f"{where}.node_role")
    call_node = _as_int(tree.call_node, "int32", f"{where}.call_node")
    c = call_node.size
    call_role = _as_int(tree.call_role, "int8", f"{where}.call_role")
    if call_role.size != c:
        raise InvalidTreeError(f"{where}.call_role: {call_role.size} values for {c} calls (call_node)")
    if len(tree.call_agent) != c:
        raise InvalidTreeError(f"{where}.call_agent: {len(tree.call_agent)} values for {c} calls (call_node)")
    if c:
        bad = np.flatnonzero((call_node < 0) | (call_node >= n))
        if bad.size:
            i = int(bad[0])
            raise InvalidTreeError(f"{where}.call_node[{i}]={call_node[i]}: not a node (tree has {n})")
        _check_codes(call_role, f"{where}.call_role")
    for name in ("run_id", "task_id"):
        if not isinstance(getattr(tree, name), str):
            raise InvalidTreeError(f"{where}.{name}: expected str, got {type(getattr(tree, name)).__name__}")
    if not all(isinstance(a, str) for a in tree.call_agent):
        raise InvalidTreeError(f"{where}.call_agent: every agent must be a str")
    for name in ("reward", "wall_s"):
        value = getattr(tree, name)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise InvalidTreeError(f"{where}.{name}={value!r}: expected a number")
    if isinstance(tree.policy_version, bool) or not isinstance(tree.policy_version, (int, np.integer)):
        raise InvalidTreeError(f"{where}.policy_version={tree.policy_version!r}: expected an int")
    if tree.status not in STATUSES:
        raise InvalidTreeError(f"{where}.status={tree.status!r}: valid statuses are {', '.join(STATUSES)}")
    _as_int(np.asarray(list(tree.dropped_calls), dtype=np.int64), "int32", f"{where}.dropped_calls")
    if tree.n_runs != 1:
        raise InvalidTreeError(f"{where}.n_runs={tree.n_runs}: a group forest is packed, not stored; store its runs")
    sample = _as_int(tree.sample_token, "int64", f"{where}.sample_token")
    if np.asarray(tree.sample_logprob).shape != sample.shape:
        raise InvalidTreeError(f"{where}.sample_logprob: shape {np.asarray(tree.sample_logprob).shape}, "
                               f"expected ({sample.size},) like sample_token")
    if np.asarray(tree.sample_call).shape != sample.shape:
        raise InvalidTreeError(f"{where}.sample_call: shape {np.asarray(tree.sample_call).shape}, "
                               f"expected ({sample.size},) like sample_token")
    _as_int(tree.sample_call, "int32", f"{where}.sample_call")
    if not np.all(np.isfinite(np.asarray(tree.sample_logprob, dtype=np.float64))):
        raise InvalidTreeError(f"{where}.sample_logprob: contains NaN or inf")
    if sample.size and (sample.min() < 0 or sample.max() >= t or np.any(np.diff(sample) < 0)):
        raise InvalidTreeError(f"{where}.sample_token: must be sorted token indices in [0, {t})")
    if not np.array_equal(np.unique(sample), np.flatnonzero(np.asarray(tree.trained, dtype=bool))):
        raise InvalidTreeError(f"{where}.sample_token: the sampled tokens must be exactly the trained ones")


def _check_codes(codes: np.ndarray, where: str) -> None:
    bad = np.flatnonzero((codes < 0) | (codes >= len(ROLES)))
    if bad.size:
        i = int(bad[0])
        raise InvalidTreeError(f"{where}[{i}]={codes[i]}: valid role codes are 0..{len(ROLES) - 1} ({', '.join(ROLES)})")


def flatten_trees(trees: list[Tree], base: dict[str, int]) -> dict[str, np.ndarray]:
    """Columns to append for ``trees`` when the store already holds ``base`` rows per dim."""
    cols: dict[str, list] = {s.name: [] for s in ARRAYS}
    off = dict(base)
    for k, tree in enumerate(trees):
        tree_index = off["tree"]
        t, n, c, d = tree.n_tokens, tree.n_nodes, tree.n_paths, len(tree.dropped_calls)
        s = int(tree.sample_token.size)
        cols["multiplicity"].append(tree.multiplicity)
        cols["sample_token"].append(np.asarray(tree.sample_token, dtype=np.int64) + off["token"])
        cols["sample_logprob"].append(np.asarray(tree.sample_logprob, dtype=np.float32))
        cols["sample_call"].append(np.asarray(tree.sample_call, dtype=np.int32))
        cols["sample_tree"].append(np.full(s, tree_index, dtype=np.int64))
        cols["tokens"].append(np.asarray(tree.tokens, dtype=np.int32))
        cols["logprobs"].append(np.asarray(tree.logprobs, dtype=np.float32))
        cols["trained"].append(np.asarray(tree.trained, dtype=bool))
        cols["node_start"].append(np.asarray(tree.node_start, dtype=np.int64) + off["token"])
        cols["node_len"].append(np.asarray(tree.node_len, dtype=np.int32))
        parent = np.asarray(tree.parent, dtype=np.int64)
        cols["parent"].append(np.where(parent < 0, -1, parent + off["node"]))
        cols["role"].append(np.asarray(tree.node_role, dtype=np.int8))
        cols["node_tree"].append(np.full(n, tree_index, dtype=np.int64))
        cols["call_node"].append(np.asarray(tree.call_node, dtype=np.int64) + off["node"])
        cols["call_role"].append(np.asarray(tree.call_role, dtype=np.int8))
        cols["call_agent"].append(np.asarray(list(tree.call_agent), dtype=object))
        cols["call_tree"].append(np.full(c, tree_index, dtype=np.int64))
        cols["dropped_call"].append(np.asarray(list(tree.dropped_calls), dtype=np.int32))
        cols["dropped_tree"].append(np.full(d, tree_index, dtype=np.int64))
        row = {
            "run_id": tree.run_id, "task_id": tree.task_id, "reward": tree.reward,
            "status": tree.status, "policy_version": tree.policy_version, "n_paths": c,
            "wall_s": tree.wall_s, "token_offset": off["token"], "n_tokens": t,
            "node_offset": off["node"], "n_nodes": n, "call_offset": off["call"],
            "dropped_offset": off["dropped"], "n_dropped": d,
            "sample_offset": off["sample"], "n_samples": s,
        }
        for name, value in row.items():
            cols[name].append(value)
        off["tree"] += 1
        off["token"] += t
        off["node"] += n
        off["call"] += c
        off["dropped"] += d
        off["sample"] += s
    out: dict[str, np.ndarray] = {}
    for spec in ARRAYS:
        dtype = object if spec.dtype == "str" else spec.dtype
        if spec.dim == "tree":
            out[spec.name] = np.asarray(cols[spec.name], dtype=dtype)
        else:
            parts = cols[spec.name]
            out[spec.name] = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
    return out


def dim_lengths(columns: dict[str, np.ndarray]) -> dict[str, int]:
    """Rows per dim in a set of columns (every array on a dim has the same length)."""
    lengths: dict[str, int] = {}
    for spec in ARRAYS:
        n = int(columns[spec.name].shape[0])
        if lengths.setdefault(spec.dim, n) != n:
            raise AssertionError(f"column {spec.name} has {n} rows, dim {spec.dim} has {lengths[spec.dim]}")
    return lengths


def tree_from_columns(row: dict, cols: dict[str, np.ndarray]) -> Tree:
    """Rebuild one ``Tree`` from its tree-dim ``row`` and its slices of the other dims."""
    token_offset, node_offset = int(row["token_offset"]), int(row["node_offset"])
    parent = np.asarray(cols["parent"], dtype=np.int64)
    # Schema 1 stored no samples: the Tree then holds one per trained token (count-once data).
    samples = {}
    if "sample_token" in cols:
        samples = dict(sample_token=np.asarray(cols["sample_token"], dtype=np.int64) - token_offset,
                       sample_logprob=np.asarray(cols["sample_logprob"], dtype=np.float32),
                       sample_call=np.asarray(cols["sample_call"], dtype=np.int32))
    return Tree(
        tokens=np.asarray(cols["tokens"], dtype=np.int32),
        logprobs=np.asarray(cols["logprobs"], dtype=np.float32),
        trained=np.asarray(cols["trained"], dtype=bool),
        node_start=np.asarray(cols["node_start"], dtype=np.int64) - token_offset,
        node_len=np.asarray(cols["node_len"], dtype=np.int32),
        parent=np.where(parent < 0, -1, parent - node_offset).astype(np.int32),
        node_role=np.asarray(cols["role"], dtype=np.int8),
        call_node=(np.asarray(cols["call_node"], dtype=np.int64) - node_offset).astype(np.int32),
        call_role=np.asarray(cols["call_role"], dtype=np.int8),
        call_agent=[str(a) for a in cols["call_agent"].tolist()],
        run_id=str(row["run_id"]),
        task_id=str(row["task_id"]),
        reward=float(row["reward"]),
        status=str(row["status"]),
        policy_version=int(row["policy_version"]),
        wall_s=float(row["wall_s"]),
        dropped_calls=[int(x) for x in np.asarray(cols["dropped_call"]).tolist()],
        **samples,
    )
