import subprocess
import sys
import textwrap
import time

from gyre_hpc.rundir.metrics import MetricsWriter, StepRow, TimelineRow, read_table


def test_rows_survive_reopen(tmp_path):
    p = tmp_path / "metrics.h5"
    with MetricsWriter(p) as w:
        w.add(TimelineRow(time=1.0, cell=2, role="TRAIN", event="flip_end", step=3, duration_s=0.5, bytes=10))
    with MetricsWriter(p) as w:
        w.add(StepRow(step=3, time=2.0, wall_s=1.5, tokens=100))
        w.event("relaunch", step=3, detail="fleet step killed")
    tl = read_table(p, "timeline")
    assert list(tl["cell"]) == [2] and list(tl["event"]) == ["flip_end"] and tl["bytes"][0] == 10
    assert read_table(p, "steps")["tokens"][0] == 100
    assert list(read_table(p, "events")["event"]) == ["relaunch"]


def test_live_reader_sees_rows_while_writer_open(tmp_path):
    """SWMR: a notebook in another process reads a run that is still writing."""
    p = tmp_path / "metrics.h5"
    w = MetricsWriter(p)
    w.add(TimelineRow(time=1.0, cell=0, role="TRAIN", event="start"))
    code = textwrap.dedent(f"""
        from gyre_hpc.rundir.metrics import read_table
        print(len(read_table({str(p)!r}, "timeline")["time"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    w.add(TimelineRow(time=2.0, cell=1, role="ROLLOUT", event="start"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2"
    w.close()


def test_a_reader_gets_complete_rows_while_an_append_is_half_done(tmp_path):
    """The writer grows a table a column at a time; a reader between two resizes saw ``time``
    a row longer than ``event`` (bench chaos died of it: IndexError in its timeline)."""
    p = tmp_path / "metrics.h5"
    with MetricsWriter(p) as w:
        w.add(TimelineRow(time=1.0, cell=0, role="TRAIN", event="start"))
        grp = w._f["timeline"]
        for col in ("time", "cell", "role", "event"):      # a second row, begun and not finished
            grp[col].resize((2,))
            grp[col][1] = b"flip_start" if col == "event" else (b"TRAIN" if col == "role" else 2)
            grp[col].flush()
    tl = read_table(p, "timeline")
    assert {len(v) for v in tl.values()} == {1}
    assert list(tl["event"]) == ["start"] and list(tl["time"]) == [1.0]
    with MetricsWriter(p) as w:                            # the next writer finishes the row
        w.add(TimelineRow(time=3.0, cell=1, role="ROLLOUT", event="end"))
    assert {len(v) for v in read_table(p, "timeline").values()} == {2}


def test_writer_waits_for_a_reader_holding_the_file_lock(tmp_path):
    """A reader (notebook, inspect, a polling test) that holds HDF5's lock when the head opens
    the file for an event must delay the head, not crash it (seen: BlockingIOError errno 11)."""
    import subprocess
    import sys

    path = tmp_path / "metrics.h5"
    with MetricsWriter(path) as w:
        w.event("start")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time, h5py\n"
                               "f = h5py.File(sys.argv[1], 'r')\nprint('held', flush=True)\ntime.sleep(1.5)\nf.close()\n",
                               str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with MetricsWriter(path) as w:        # raises BlockingIOError without the wait
        w.event("after")
    holder.wait(10)
    assert list(read_table(path, "events")["event"]) == ["start", "after"]


def test_a_file_from_before_a_column_joined_reads_and_appends_with_it(tmp_path):
    """Columns added to the schema (timeline requests/tokens, steps recomputed_prefill_tokens):
    an older file's rows read as 0, and rows appended later keep every column aligned."""
    import h5py

    p = tmp_path / "metrics.h5"
    with MetricsWriter(p) as w:
        w.add(TimelineRow(time=1.0, cell=2, role="TRAIN", event="flip_end", bytes=10))
    with h5py.File(p, "a") as f:            # make it look like a file written before the columns
        del f["timeline"]["requests"], f["timeline"]["tokens"]
    assert list(read_table(p, "timeline")["requests"]) == [0]
    with MetricsWriter(p) as w:
        w.add(TimelineRow(time=2.0, cell=1, role="ROLLOUT", event="migrate", bytes=64, requests=3, tokens=900))
    tl = read_table(p, "timeline")
    assert list(tl["event"]) == ["flip_end", "migrate"]
    assert list(tl["requests"]) == [0, 3] and list(tl["tokens"]) == [0, 900] and list(tl["bytes"]) == [10, 64]


def test_writer_waits_for_a_reader_in_its_own_process(tmp_path):
    """The progress display reads metrics.h5 from a thread of the head while the supervisor
    writes its events: HDF5 refuses the writer ("already open for read-only") until the
    reader closes. Seen crashing ``gyre-hpc run`` at its last event in CI."""
    import threading

    import h5py

    path = tmp_path / "metrics.h5"
    with MetricsWriter(path) as w:
        w.event("start")
    held = threading.Event()

    def reader():
        with h5py.File(path, "r", libver="latest", swmr=True):
            held.set()
            time.sleep(1.0)

    t = threading.Thread(target=reader)
    t.start()
    held.wait(10)
    with MetricsWriter(path) as w:        # OSError "already open for read-only" without the wait
        w.event("after")
    t.join()
    assert list(read_table(path, "events")["event"]) == ["start", "after"]


def test_reader_waits_out_a_writer_before_its_swmr_switch(tmp_path):
    """A writer holds HDF5's lock exclusively from its open until ``swmr_mode = True``; the head
    reopens the file for each event, so a reader polling a live run meets that window (CI:
    BlockingIOError errno 11 polling ``events`` as a requeued head resumed). It must wait."""
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path) as w:
        w.event("start")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time, h5py\n"
                               "f = h5py.File(sys.argv[1], 'a', libver='latest')\nprint('held', flush=True)\n"
                               "time.sleep(1.5)\nf.close()\n",
                               str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    assert list(read_table(path, "events")["event"]) == ["start"]   # BlockingIOError without the wait
    assert time.monotonic() - t0 > 0.5
    holder.wait(10)


def test_writers_reopening_beside_a_reader_thread_of_their_own_process(tmp_path):
    """The head writes each event with a fresh writer while its progress thread polls the file.
    A reader opened in this process while a writer is open keeps HDF5's shared file (in
    SWMR-write mode) alive past the writer's close, and the next writer joined it and failed to
    start SWMR ("file already in SWMR writing mode"): CI saw the head crash so at its "finish"
    event; 149 of 300 reopenings failed here before the fix."""
    import threading

    path = tmp_path / "metrics.h5"
    with MetricsWriter(path) as w:
        w.event("start")
    stop = threading.Event()
    reads: list[int] = []

    def poll():
        while not stop.is_set():
            reads.append(len(read_table(path, "events")["event"]))

    t = threading.Thread(target=poll)
    t.start()
    try:
        for i in range(150):
            with MetricsWriter(path) as w:
                w.event("e", i)
    finally:
        stop.set()
        t.join()
    assert len(read_table(path, "events")["event"]) == 151
    assert len(reads) > 10 and reads == sorted(reads)
