"""The tree store against real Zarr v3 stores on disk, real writer/reader processes, SIGKILL."""
from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import crc32c
import numpy as np
import pytest
import xarray as xr
import zarr

from gyre_hpc.bench.store import random_tree
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import Tree
from gyre_hpc.trees.store import (
    ChunkCorruptError, InvalidTreeError, StoreError, StoreLayout, TreeStore,
)
from gyre_hpc.trees.store_commit import extend_checksums, marker_path
from gyre_hpc.trees.store_schema import ARRAYS, SPECS, canonical_bytes
from gyre_hpc.trees.synthetic import synthetic_runs

# Small chunks so a handful of trees crosses many chunk boundaries in every dimension.
SMALL = StoreLayout(token_chunk=512, node_chunk=16, call_chunk=16, dropped_chunk=4, tree_chunk=4)


def assert_trees_equal(a: Tree, b: Tree) -> None:
    for name in Tree.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f"{name}: dtype {x.dtype} != {y.dtype}"
            assert np.array_equal(x, y), f"{name} differs"
        else:
            assert x == y, f"{name}: {x!r} != {y!r}"


def sample_trees(seeds) -> list[Tree]:
    return [random_tree(s, n_nodes=int(np.random.default_rng(s).integers(0, 30))) for s in seeds]


def test_round_trip_keeps_every_field(tmp_path):
    trees = sample_trees(range(12)) + [random_tree(100, n_nodes=0), random_tree(101, n_nodes=1)]
    assert any(t.n_tokens == 0 for t in trees) and any(len(t.dropped_calls) for t in trees)
    path = tmp_path / "trees.zarr"
    with TreeStore.open(path, "a", layout=SMALL) as store:
        assert store.append(trees[:5]) == range(0, 5)
        assert store.append([]) == range(5, 5)
        assert store.append(trees[5:]) == range(5, len(trees))
        assert_trees_equal(store.read(3), trees[3])        # the writer reads its own commits
    reader = TreeStore.open(path)
    assert len(reader) == len(trees)
    for i, tree in enumerate(trees):
        assert_trees_equal(reader.read(i), tree)
    assert_trees_equal(reader.read(-1), trees[-1])
    for got, want in zip(reader.iter_trees(start=4), trees[4:], strict=True):
        assert_trees_equal(got, want)
    assert reader.run_ids() == [t.run_id for t in trees]
    with pytest.raises(IndexError, match=f"has {len(trees)} committed trees"):
        reader.read(len(trees))
    report = reader.verify()
    assert report.rows["tree"] == len(trees) and report.rows["token"] == sum(t.n_tokens for t in trees)
    assert report.chunks == sum(-(-report.rows[s.dim] // SMALL.chunk(s.dim)) for s in ARRAYS)


def test_trees_built_from_synthetic_journals_round_trip_with_their_paths(tmp_path):
    runs = synthetic_runs(n_tasks=2, runs_per_task=2, seed=3)
    trees = [build_tree(r.journal, run_id=r.run_id, task_id=r.task_id, reward=r.reward, policy_version=7)
             for r in runs]
    # Chunks well below a tree's ~16k tokens, but not so small that 64k tokens take 128 files.
    layout = StoreLayout(token_chunk=4096, node_chunk=64, call_chunk=64, dropped_chunk=4, tree_chunk=2)
    with TreeStore.open(tmp_path / "t.zarr", "a", layout=layout) as store:
        store.append(trees[:1])
        store.append(trees[1:])
    reader = TreeStore.open(tmp_path / "t.zarr")
    for i, (tree, run) in enumerate(zip(trees, runs)):
        got = reader.read(i)
        assert_trees_equal(got, tree)
        for c, call in enumerate(run.journal):   # each call's exact context survives the store
            assert np.array_equal(got.path(c), np.concatenate([call.prompt, call.output]))


def test_xarray_open_zarr_reads_named_dims_and_absolute_indices(tmp_path):
    trees = sample_trees(range(6))
    path = tmp_path / "trees.zarr"
    with TreeStore.open(path, "a", layout=SMALL) as store:
        store.append(trees)
        committed = store.marker.lengths
    ds = xr.open_zarr(path, consolidated=False)
    assert dict(ds.sizes) == committed
    for spec in ARRAYS:
        assert ds[spec.name].dims == (spec.dim,), spec.name
    assert ds.attrs["gyre_tree_store"]["schema_version"] == 2
    # Every sampling event with its own behaviour logprob, and the multiplicity per token.
    assert int(ds.sizes["sample"]) == sum(t.sample_token.size for t in trees)
    np.testing.assert_array_equal(ds["multiplicity"].values, np.concatenate([t.multiplicity for t in trees]))
    assert ds["role"].attrs["codes"] == ["main", "subagent", "summary"]
    assert [str(x) for x in ds["run_id"].values] == [t.run_id for t in trees]
    assert [str(x) for x in ds["status"].values] == [t.status for t in trees]
    # node_start / parent / call_node are absolute, so a notebook follows them directly.
    k, tree = 4, trees[4]
    node0 = int(ds["node_offset"][k])
    for n in range(tree.n_nodes):
        start, length = int(ds["node_start"][node0 + n]), int(ds["node_len"][node0 + n])
        assert np.array_equal(ds["tokens"].values[start:start + length],
                              tree.tokens[tree.node_start[n]:tree.node_start[n] + tree.node_len[n]])
        p = int(ds["parent"][node0 + n])
        assert p == (-1 if tree.parent[n] < 0 else node0 + tree.parent[n])
        assert int(ds["node_tree"][node0 + n]) == k
    view = TreeStore.open(path).dataset()
    assert dict(view.sizes) == committed


def test_invalid_tree_is_refused_naming_field_and_nothing_is_written(tmp_path):
    path = tmp_path / "trees.zarr"
    store = TreeStore.open(path, "a", layout=SMALL)
    store.append(sample_trees([1, 2]))
    before = marker_path(path).read_bytes()
    bad = random_tree(5, n_nodes=8)
    bad.parent = bad.parent.copy()
    bad.parent[3] = 5
    with pytest.raises(InvalidTreeError, match=r"trees\[1\]\.parent\[3\]=5"):
        store.append([random_tree(4), bad])
    wrong_status = random_tree(6)
    wrong_status.status = "done"
    with pytest.raises(InvalidTreeError, match=r"trees\[0\]\.status='done'.*finished"):
        store.append([wrong_status])
    short = random_tree(7, n_nodes=5)
    short.logprobs = short.logprobs[:-1]
    with pytest.raises(InvalidTreeError, match=r"trees\[0\]\.logprobs"):
        store.append([short])
    no_reward = random_tree(8)
    no_reward.reward = "0.5"
    with pytest.raises(InvalidTreeError, match=r"trees\[0\]\.reward='0.5': expected a number"):
        store.append([no_reward])
    assert marker_path(path).read_bytes() == before and len(store) == 2
    store.append(sample_trees([3]))
    store.close()
    assert TreeStore.open(path).run_ids() == ["run-000001", "run-000002", "run-000003"]


def test_open_errors_name_the_file(tmp_path):
    with pytest.raises(StoreError, match=f"{tmp_path / 'nope.zarr'} does not exist"):
        TreeStore.open(tmp_path / "nope.zarr")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match=r"empty/zarr\.json is missing"):
        TreeStore.open(tmp_path / "empty", "a")
    zarr.open_group(tmp_path / "plain.zarr", mode="w", zarr_format=3)
    with pytest.raises(StoreError, match=r"plain\.zarr/zarr\.json: not a gyre tree store"):
        TreeStore.open(tmp_path / "plain.zarr")
    with pytest.raises(ValueError, match="valid modes are 'r'"):
        TreeStore.open(tmp_path / "x.zarr", "w")

    path = tmp_path / "trees.zarr"
    with TreeStore.open(path, "a", layout=SMALL) as store:
        store.append(sample_trees([1, 2, 3]))
    good = marker_path(path).read_bytes()
    marker_path(path).write_bytes(good[: len(good) // 2])          # a half-written marker
    with pytest.raises(StoreError, match=r"control/commit\.json is not valid JSON"):
        TreeStore.open(path)
    data = json.loads(good)
    data["schema_version"] = 99
    marker_path(path).write_text(json.dumps(data))
    with pytest.raises(StoreError, match=r"commit\.json: schema_version 99, this code reads versions 1, 2"):
        TreeStore.open(path)
    data = json.loads(good)
    data["checksums"]["tokens"].pop()
    marker_path(path).write_text(json.dumps(data))
    with pytest.raises(StoreError, match=r"commit\.json: checksums\.tokens has"):
        TreeStore.open(path)
    marker_path(path).unlink()
    with pytest.raises(StoreError, match=r"control/commit\.json is missing"):
        TreeStore.open(path)
    marker_path(path).write_bytes(good)

    array_meta = (path / "reward" / "zarr.json").read_bytes()
    (path / "reward" / "zarr.json").write_bytes(array_meta[:40])
    with pytest.raises(StoreError, match=r"reward/zarr\.json: cannot open array 'reward'"):
        TreeStore.open(path)
    (path / "reward" / "zarr.json").write_bytes(array_meta)

    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["gyre_tree_store"]["schema_version"] = 3
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"trees\.zarr/zarr\.json: schema_version 3, this code reads versions 1, 2"):
        TreeStore.open(path)
    meta["attributes"]["gyre_tree_store"]["schema_version"] = 2
    meta["attributes"]["gyre_tree_store"]["layout"]["token_chunk"] = "big"
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"trees\.zarr/zarr\.json: bad store layout .*token_chunk='big'"):
        TreeStore.open(path)
    meta["attributes"]["gyre_tree_store"]["layout"]["token_chunk"] = SMALL.token_chunk
    (path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="was created with"):
        TreeStore.open(path, "a", layout=StoreLayout())
    assert len(TreeStore.open(path)) == 3            # every error above left the trees intact


def test_layout_rejects_bad_chunk_sizes():
    with pytest.raises(ValueError, match=r"StoreLayout\.token_chunk=0"):
        StoreLayout(token_chunk=0)
    with pytest.raises(ValueError, match=r"StoreLayout\.zstd_level=30"):
        StoreLayout(zstd_level=30)


def test_only_one_writer_at_a_time(tmp_path):
    path = tmp_path / "trees.zarr"
    first = TreeStore.open(path, "a", layout=SMALL)
    with pytest.raises(StoreError, match=r"control/writer\.lock: another process is writing"):
        TreeStore.open(path, "a")
    reader = TreeStore.open(path)
    with pytest.raises(StoreError, match="opened read-only"):
        reader.append(sample_trees([1]))
    first.close()
    TreeStore.open(path, "a").close()


def test_checksums_extend_chunk_by_chunk_like_a_fresh_computation():
    rng = np.random.default_rng(0)
    for spec in (SPECS["tokens"], SPECS["call_agent"], SPECS["trained"]):
        n = 300
        if spec.dtype == "str":
            values = np.asarray([f"a{'é' * int(k % 5)}{k}" for k in range(n)], dtype=object)
        else:
            values = rng.integers(0, 2 if spec.dtype == "bool" else 10**6, size=n).astype(spec.dtype)
        crcs, pos = [], 0
        for cut in sorted(rng.integers(0, n, size=7).tolist()) + [n]:
            crcs = extend_checksums(crcs, pos, values[pos:cut], 64, spec)
            pos = cut
        fresh = [crc32c.crc32c(canonical_bytes(values[k:k + 64], spec)) for k in range(0, n, 64)]
        assert crcs == fresh, spec.name


def test_reader_refresh_sees_commits_made_after_it_opened(tmp_path):
    path = tmp_path / "trees.zarr"
    writer = TreeStore.open(path, "a", layout=SMALL)
    reader = TreeStore.open(path)
    assert len(reader) == 0
    trees = sample_trees(range(5))
    writer.append(trees[:2])
    assert len(reader) == 0 and reader.refresh() == 2
    assert_trees_equal(reader.read(1), trees[1])
    writer.append(trees[2:])           # grows arrays past the reader's cached Zarr metadata
    assert reader.refresh() == 5
    assert_trees_equal(reader.read(4), trees[4])
    # A stream ends after timeout_s without new trees while the writer is open...
    t0 = time.monotonic()
    assert [t.run_id for t in reader.stream(start=3, poll_s=0.05, timeout_s=0.3)] == ["run-000003", "run-000004"]
    assert 0.25 < time.monotonic() - t0 < 5
    # ...and at once when the writer closed the store and every tree was yielded.
    writer.close()
    t0 = time.monotonic()
    assert len(list(reader.stream(poll_s=0.05, timeout_s=30))) == 5
    assert time.monotonic() - t0 < 5


# ---- corruption -------------------------------------------------------------------------

def _store_with_trees(path: Path, n: int = 10) -> list[Tree]:
    trees = [random_tree(s, n_nodes=20) for s in range(n)]
    with TreeStore.open(path, "a", layout=SMALL) as store:
        store.append(trees[:4])
        store.append(trees[4:])
    return trees


def _trees_touching_token_chunk(store: TreeStore, chunk: int) -> set[int]:
    ds = store.dataset()
    size = store.layout.token_chunk
    return {i for i, (o, c) in enumerate(zip(ds["token_offset"].values, ds["n_tokens"].values))
            if c and o // size <= chunk <= (o + c - 1) // size}


def test_flipped_bytes_in_a_chunk_file_are_reported_by_array_and_chunk(tmp_path):
    path = tmp_path / "trees.zarr"
    trees = _store_with_trees(path)
    chunk_file = path / "tokens" / "c" / "2"
    raw = bytearray(chunk_file.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    chunk_file.write_bytes(bytes(raw))

    store = TreeStore.open(path)
    with pytest.raises(ChunkCorruptError) as err:
        store.verify()
    assert (err.value.array, err.value.chunk, err.value.path) == ("tokens", 2, str(chunk_file))
    assert len(err.value.corrupt) == 1 and "array 'tokens' chunk 2" in str(err.value)
    touching = _trees_touching_token_chunk(store, 2)
    for i in range(len(trees)):
        if i in touching:
            with pytest.raises(ChunkCorruptError, match="array 'tokens' chunk 2"):
                store.read(i)
        else:                              # trees elsewhere still read back intact
            assert_trees_equal(store.read(i), trees[i])
    assert touching and len(touching) < len(trees)


def test_missing_or_swapped_chunks_are_caught_by_the_commit_checksums(tmp_path):
    path = tmp_path / "trees.zarr"
    _store_with_trees(path)
    (path / "logprobs" / "c" / "1").unlink()                      # Zarr would read fill values
    (path / "tokens" / "c" / "3").write_bytes((path / "tokens" / "c" / "0").read_bytes())  # valid, stale
    with pytest.raises(ChunkCorruptError) as err:
        TreeStore.open(path).verify()
    found = {(c.array, c.chunk): c.reason for c in err.value.corrupt}
    assert set(found) == {("logprobs", 1), ("tokens", 3)}
    assert "missing" in found[("logprobs", 1)] and "differ" in found[("tokens", 3)]


def test_writer_refuses_to_extend_a_corrupt_committed_tail(tmp_path):
    path = tmp_path / "trees.zarr"
    _store_with_trees(path)
    n_chunks = len(TreeStore.open(path).marker.checksums["node_len"])
    tail = path / "node_len" / "c" / str(n_chunks - 1)
    raw = bytearray(tail.read_bytes())
    raw[0] ^= 0xFF
    tail.write_bytes(bytes(raw))
    with pytest.raises(ChunkCorruptError, match=f"array 'node_len' chunk {n_chunks - 1}"):
        TreeStore.open(path, "a")
    with pytest.raises(ChunkCorruptError):
        TreeStore.open(path, "a")          # the failed open released the lock: not "another writer"


# ---- processes: a killed writer, a streaming reader --------------------------------------

WRITER = r"""
import sys, time
import gyre_hpc.trees.store as store_mod
from gyre_hpc.bench.store import random_tree
from gyre_hpc.trees.store import StoreLayout, TreeStore

path, target, batch, stall_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
real_write_marker = store_mod.write_marker
def stalling_write_marker(root, marker, durable=True):
    # Test hook: with every chunk of an append written, stop just before the commit.
    if marker.n_trees >= stall_at > 0:
        print("stalled", marker.n_trees, flush=True)
        time.sleep(60)
    real_write_marker(root, marker, durable)
store_mod.write_marker = stalling_write_marker
layout = StoreLayout(token_chunk=512, node_chunk=16, call_chunk=16, dropped_chunk=4, tree_chunk=4)
store = TreeStore.open(path, "a", layout=layout, durable=False)
print("opened", len(store), flush=True)
while len(store) < target:
    n = len(store)
    store.append([random_tree(s, n_nodes=12 + s % 17) for s in range(n, min(n + batch, target))])
    print("committed", len(store), flush=True)
store.close()
print("closed", flush=True)
"""


class ProcLines:
    """A child's stdout line by line, read straight from the pipe's fd: ``select`` on a
    buffered file object misses lines already sitting in its buffer."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.fd, self.buf, self.eof = proc, proc.stdout.fileno(), b"", False

    def _fill(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            data = os.read(self.fd, 1 << 16)
            self.eof = not data
            self.buf += data

    def _take_lines(self) -> list[str]:
        *lines, self.buf = self.buf.split(b"\n")
        return [x.decode().strip() for x in lines]

    def until(self, want: str, timeout: float = 60.0) -> list[str]:
        """Lines up to and including the first that starts with ``want``; the rest stay."""
        deadline = time.monotonic() + timeout
        got: list[str] = []
        while True:
            lines = self._take_lines()
            for k, line in enumerate(lines):
                if line.startswith(want):
                    rest = "\n".join(lines[k + 1:])
                    self.buf = (rest + "\n" if rest else "").encode() + self.buf
                    return got + lines[:k + 1]
            got += lines
            if self.eof or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"no {want!r} line within {timeout}s; got {got}; "
                                     f"stderr: {self.proc.stderr.read().decode()}")
            self._fill(max(0.0, deadline - time.monotonic()))

    def rest(self) -> list[str]:
        """Every remaining line, once the child has exited."""
        while not self.eof:
            self._fill(10.0)
        return self._take_lines() + ([self.buf.decode().strip()] if self.buf else [])


def _spawn(script: str, *args) -> tuple[subprocess.Popen, ProcLines]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    return proc, ProcLines(proc)


def test_sigkilled_writer_leaves_exactly_the_committed_trees_and_a_new_writer_continues(tmp_path):
    path = tmp_path / "trees.zarr"
    rng = random.Random(1234)
    batch, target = 3, 200
    last = 0
    caught_uncommitted = 0
    for rep in range(6):
        deterministic = rep % 2 == 0
        stall_at = last + batch * rng.randint(1, 3) if deterministic else 0
        proc, out = _spawn(WRITER, path, target, batch, stall_at)
        opened = out.until("opened")
        assert opened[-1] == f"opened {last}"      # resumes exactly at the last commit
        lines = []
        if deterministic:
            lines = out.until("stalled")
        else:
            time.sleep(rng.uniform(0.0, 0.4))     # anywhere in an append, its commit or its print
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        printed = [int(x.split()[1]) for x in lines + out.rest() if x.startswith("committed")]
        seen = printed[-1] if printed else last

        shapes = {s.name: zarr.open_array(path / s.name, mode="r").shape[0] for s in ARRAYS}
        reader = TreeStore.open(path)
        n = len(reader)
        if deterministic:
            assert n == seen == stall_at - batch
            assert shapes["tokens"] > reader.marker.lengths["token"]   # data of the killed append on disk
            caught_uncommitted += 1
        else:
            assert seen <= n <= seen + batch        # killed before or after its print
        assert reader.run_ids() == [f"run-{s:06d}" for s in range(n)]   # each tree exactly once
        for i in rng.sample(range(n), min(n, 8)):
            assert_trees_equal(reader.read(i), random_tree(i, n_nodes=12 + i % 17))
        assert dict(reader.dataset().sizes) == reader.marker.lengths   # uncommitted rows hidden
        last = n
    assert caught_uncommitted == 3

    proc, _ = _spawn(WRITER, path, last + 7, batch, 0)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode()
    assert stdout.decode().split("\n")[0] == f"opened {last}"
    store = TreeStore.open(path)
    assert store.run_ids() == [f"run-{s:06d}" for s in range(last + 7)]
    assert store.verify().rows["tree"] == last + 7
    assert not [p for p in path.rglob("*") if p.name.endswith(".partial")]
    for s in (spec.name for spec in ARRAYS):    # truncation left no rows past the commit
        assert zarr.open_array(path / s, mode="r").shape[0] == store.marker.lengths[SPECS[s].dim]


READER = r"""
import sys, crc32c
from gyre_hpc.trees.store import TreeStore
for tree in TreeStore.open(sys.argv[1]).stream(poll_s=0.05, timeout_s=60):
    print(tree.run_id, crc32c.crc32c(tree.tokens.tobytes() + tree.logprobs.tobytes()), flush=True)
print("end", flush=True)
"""


def test_stream_in_another_process_yields_each_commit_as_it_lands(tmp_path):
    path = tmp_path / "trees.zarr"
    writer = TreeStore.open(path, "a", layout=SMALL)
    proc, out = _spawn(READER, path)
    try:
        for b in range(4):
            trees = [random_tree(s, n_nodes=20) for s in range(3 * b, 3 * b + 3)]
            writer.append(trees)
            lines = out.until(trees[-1].run_id, timeout=30)   # seen before the next commit
            assert lines == [f"{t.run_id} {crc32c.crc32c(t.tokens.tobytes() + t.logprobs.tobytes())}"
                             for t in trees]
        writer.close()
        assert out.until("end", timeout=30) == ["end"]
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        writer.close()


def test_dataset_view_survives_arrays_of_unequal_length_left_by_a_dead_writer(tmp_path):
    path = tmp_path / "trees.zarr"
    trees = sample_trees(range(5))
    with TreeStore.open(path, "a", layout=SMALL) as store:
        store.append(trees)
        committed = store.marker.lengths
    # What a writer killed between two resizes leaves: one token array already grown.
    zarr.open_array(path / "tokens", mode="r+").resize((committed["token"] + 100,))
    with pytest.raises(ValueError, match="conflicting sizes for dimension 'token'"):
        xr.open_zarr(path, consolidated=False)
    view = TreeStore.open(path).dataset()
    assert dict(view.sizes) == committed
    assert np.array_equal(view["tokens"].values, np.concatenate([t.tokens for t in trees]))
    with TreeStore.open(path, "a"):        # the next writer truncates the residue
        pass
    assert dict(xr.open_zarr(path, consolidated=False).sizes) == committed


def test_stream_reader_sees_each_tree_once_across_a_killed_and_relaunched_writer(tmp_path):
    path = tmp_path / "trees.zarr"
    first, out = _spawn(WRITER, path, 30, 3, 9)              # stalls before committing tree 9
    out.until("opened")
    reader, lines = _spawn(READER, path)     # the writer has the store open: the stream waits
    try:
        out.until("stalled")
        first.send_signal(signal.SIGKILL)                     # trees 6..8 written, never committed
        first.wait(timeout=30)
        got = lines.until("run-000005", timeout=30)
        second, _ = _spawn(WRITER, path, 30, 3, 0)            # the relaunch: truncates, continues
        assert second.wait(timeout=120) == 0, second.stderr.read().decode()
        got += lines.until("end", timeout=60)
        assert reader.wait(timeout=30) == 0
    finally:
        reader.kill()
    ids = [line.split()[0] for line in got[:-1]]
    assert ids == [f"run-{s:06d}" for s in range(30)]        # in order, none lost, none twice


V1_STORE = Path(__file__).parent / "data" / "trees_v1.zarr"


def test_a_store_written_in_schema_1_still_reads_with_one_sample_per_trained_token(tmp_path):
    """tests/trees/data/trees_v1.zarr was written by the schema-1 code (data/write_v1.py, run
    against main before the bump). It reads: same tokens, nodes, calls; no multiplicity was
    recorded then, so each trained token carries one sample (the first call's logprob)."""
    import shutil

    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.model import ModelCall

    copy = tmp_path / "old.zarr"
    shutil.copytree(V1_STORE, copy)
    store = TreeStore.open(copy)
    assert store.schema_version == 1 and len(store) == 2
    store.verify()
    a, b = store.read(0), store.read(1)
    rebuilt = build_tree([ModelCall([257, 1, 2], [3, 4], [-0.5, -0.25]), ModelCall([257, 1, 2], [3, 4], [-0.75, -0.125])])
    np.testing.assert_array_equal(a.tokens, rebuilt.tokens)
    np.testing.assert_array_equal(a.trained, rebuilt.trained)
    np.testing.assert_array_equal(a.logprobs, rebuilt.logprobs)
    assert rebuilt.multiplicity[rebuilt.trained].tolist() == [2, 2]     # what schema 2 records
    assert a.multiplicity[a.trained].tolist() == [1, 1]                 # what schema 1 knew
    np.testing.assert_array_equal(a.sample_logprob, np.float32([-0.5, -0.25]))
    assert a.sample_call.tolist() == [-1, -1]                            # not recorded then
    assert (b.run_id, b.status, b.n_paths, int(b.trained.sum())) == ("b", "timeout", 3, 4)  # 6 7 8, and 1 (7 is shared)
    assert int(store.dataset().sizes["token"]) == a.n_tokens + b.n_tokens
    with pytest.raises(StoreError, match=r"schema 1 store is read-only to this code.*mode='r'"):
        TreeStore.open(copy, "a", durable=False)
