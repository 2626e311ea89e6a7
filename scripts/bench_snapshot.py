"""Workspace snapshot cost on an xlong-large workspace (issue 53: time and bytes per snapshot,
and its share of a run's wall time). Prints JSON.

    .venv/bin/python scripts/bench_snapshot.py [--task xl-p11] [--reps 20] [--call-s 1.08]

The run between two snapshots is modelled by what ``snapshot_every`` calls of an xlong run do:
about three calls per module (test, read, write), so each interval rewrites ``every / 3``
modules. The baseline, measured in the same run, is a plain copy of the workspace
(``shutil.copytree``), what a snapshot without a content store would cost. ``--call-s``: the
wall time of one call of a run; the default is the xlong-large bench's (docs/harness.md, "On
xlong-large": a 705 s step whose longest run made 654 calls, so <= 705/654 = 1.08 s a call).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from gyre_hpc.harness.snapshot import SnapshotStore
from gyre_hpc.harness.tasks.xlong import XLONG_LARGE, XLONG_PLAYBOOKS, module_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="xl-p11")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--call-s", type=float, default=705 / 654)
    args = ap.parse_args()
    task = next(t for t in XLONG_LARGE if t.task_id == args.task)
    modules = XLONG_PLAYBOOKS[task.task_id].modules
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ws = task.materialize(root / "ws")
        files = sum(1 for p in ws.rglob("*") if p.is_file())
        ws_bytes = sum(p.stat().st_size for p in ws.rglob("*") if p.is_file())
        store = SnapshotStore(root / "store")
        t0 = time.perf_counter()
        first = store.snapshot(ws, 0)
        first_s = time.perf_counter() - t0
        first_manifest = store.manifest_path(0).stat().st_size
        per_interval = max(1, round(args.every / 3))
        inc_s, inc_new, inc_manifest, unchanged_s = [], [], [], []
        for r in range(args.reps):
            t0 = time.perf_counter()
            m = store.snapshot(ws, 2 * r + 1)              # nothing changed since the last one
            unchanged_s.append(time.perf_counter() - t0)
            assert m.new_bytes == 0
            for mod in modules[r * per_interval:(r + 1) * per_interval]:
                (ws / mod.path).write_text(module_source(mod.want))
            t0 = time.perf_counter()
            m = store.snapshot(ws, 2 * r + 2)
            inc_s.append(time.perf_counter() - t0)
            inc_new.append(m.new_bytes)
            inc_manifest.append(store.manifest_path(2 * r + 2).stat().st_size)
        t0 = time.perf_counter()
        store.restore(store.latest(), root / "restored")
        restore_s = time.perf_counter() - t0
        copy_s = []
        for r in range(5):
            t0 = time.perf_counter()
            shutil.copytree(ws, root / f"copy{r}", symlinks=True)
            copy_s.append(time.perf_counter() - t0)
        snap = statistics.median(inc_s)
        interval_s = args.every * args.call_s
        print(json.dumps({
            "task": task.task_id, "files": files, "workspace_bytes": ws_bytes, "snapshot_every": args.every,
            "first": {"s": round(first_s, 5), "blob_bytes": first.new_bytes, "manifest_bytes": first_manifest},
            "incremental": {"modules_rewritten": per_interval, "median_s": round(snap, 5),
                            "max_s": round(max(inc_s), 5), "new_blob_bytes": statistics.median(inc_new),
                            "manifest_bytes": statistics.median(inc_manifest)},
            "unchanged": {"median_s": round(statistics.median(unchanged_s), 5), "new_blob_bytes": 0},
            "restore_s": round(restore_s, 5),
            "baseline_copytree_median_s": round(statistics.median(copy_s), 5),
            "snapshot_over_copytree": round(snap / statistics.median(copy_s), 3),
            "call_s_assumed": round(args.call_s, 4),
            "share_of_run_wall": round(snap / (interval_s + snap), 5),
            "store_bytes_after": store.blob_bytes(),
        }, indent=1))


if __name__ == "__main__":
    main()
