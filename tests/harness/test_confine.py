"""Escape attempts against the real confinement: real processes, real files, real limits."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from gyre_hpc.harness.confine import Limits, isolation_mode, run_confined, sandbox_uid
from gyre_hpc.harness.tools import ToolError, Workspace

needs_root = pytest.mark.skipif(isolation_mode() != "root",
                                reason="jail mode needs root (namespaces + uid drop); plain mode documented")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    d = tmp_path / "ws"
    d.mkdir()
    (d / "hello.txt").write_text("hi\n")
    return d


def _procs_of_uid(uid: int, settle_s: float = 3.0) -> list[int]:
    """Live processes of ``uid``, after letting a killed PID namespace finish tearing down."""
    deadline = time.monotonic() + settle_s
    while True:
        pids = _scan_uid(uid)
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def _procs_running(argv: bytes, settle_s: float = 3.0) -> list[int]:
    """Live processes whose whole argv is ``argv`` (NUL-separated), after a teardown settles.

    The whole argv, not a substring: another program on the machine whose arguments happen
    to contain "sleep 300" (a test's srun line) must not fail this test.
    """
    deadline = time.monotonic() + settle_s
    while True:
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\x00") == argv:
                        found.append(int(pid))
                except OSError:
                    pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _scan_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = Path(f"/proc/{entry}/stat").read_text()
                if os.stat(f"/proc/{entry}").st_uid == uid and st.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids


def test_command_runs_in_workspace_and_sees_its_files(ws):
    r = run_confined("cat hello.txt && echo made > new.txt", ws)
    assert r.ok and r.output == b"hi\n"
    assert (ws / "new.txt").read_text() == "made\n"


@needs_root
def test_command_write_through_dotdot_is_refused(ws):
    r = run_confined("echo pwned > ../escaped.txt", ws)
    assert not r.ok
    assert b"Read-only file system" in r.output
    assert not (ws.parent / "escaped.txt").exists()


@needs_root
def test_command_write_through_symlink_is_refused(ws):
    # A world-writable directory outside /tmp, so only the jail (not Unix permissions, not
    # the /tmp overlay) stands between the command and the write.
    outside = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-escape-"))
    try:
        outside.chmod(0o777)
        os.symlink(outside, ws / "door")
        os.symlink("..", ws / "up")
        r = run_confined("echo pwned > door/escaped.txt; echo pwned > up/escaped.txt; "
                         "echo pwned > /var/tmp/escaped-gyre.txt", ws)
        assert list(outside.iterdir()) == []
        assert not (ws.parent / "escaped.txt").exists()
        assert not Path("/var/tmp/escaped-gyre.txt").exists()
        # refused: read-only where the path exists in the jail, absent where it does not
        assert r.output.count(b"Read-only file system") + r.output.count(b"Directory nonexistent") == 3
    finally:
        shutil.rmtree(outside)


@needs_root
def test_command_runs_as_unprivileged_uid_without_network(ws):
    r = run_confined("id -u; cat /proc/net/dev | wc -l", ws)
    uid, dev_lines = r.output.split()
    assert int(uid) == sandbox_uid(ws) != 0
    assert int(dev_lines) == 3  # two header lines + loopback only: a fresh network namespace


def test_file_tools_refuse_dotdot_absolute_and_symlink(ws):
    outside = ws.parent / "secret.txt"
    outside.write_text("secret")
    os.symlink(outside, ws / "link")
    tools = Workspace(ws)
    for bad in ("../secret.txt", str(outside), "link", "sub/../../secret.txt"):
        with pytest.raises(ToolError, match="leads outside the workspace|absolute"):
            tools.read(bad)
    with pytest.raises(ToolError):
        tools.write("../pwned.txt", b"x")
    with pytest.raises(ToolError):
        tools.write("link", b"x")
    assert outside.read_text() == "secret"
    assert not (ws.parent / "pwned.txt").exists()
    with pytest.raises(ToolError, match="outside"):
        tools.list("..")
    assert tools.read("a/../hello.txt") == b"hi\n"
    os.symlink("hello.txt", ws / "inner")     # a link that stays inside still works
    assert tools.read("inner") == b"hi\n"


def test_parent_environment_secret_is_not_visible(ws, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_SECRET", "hunter2-token")
    r = run_confined("env; cat /proc/$PPID/environ 2>/dev/null; cat /proc/1/environ 2>/dev/null; true", ws)
    assert r.ok
    assert b"hunter2-token" not in r.output
    assert b"GYRE_TEST_SECRET" not in r.output


def test_never_returning_command_is_killed_with_its_children(ws):
    limits = Limits(wall_s=1.0)
    t0 = time.monotonic()
    r = run_confined("sleep 3170 & setsid sleep 3171 & sleep 3172", ws, limits)
    assert r.timed_out and r.returncode is None
    assert time.monotonic() - t0 < 5
    if isolation_mode() == "root":
        assert _procs_of_uid(sandbox_uid(ws)) == []
    assert _procs_running(b"sleep\x003170") == [] and _procs_running(b"sleep\x003172") == []
    if isolation_mode() != "plain":
        assert _procs_running(b"sleep\x003171") == []   # setsid does not leave the PID namespace


@needs_root
def test_fork_bomb_is_bounded_and_cleaned_up(ws):
    limits = Limits(wall_s=3.0, nproc=32, cpu_s=5)
    t0 = time.monotonic()
    r = run_confined("bomb() { bomb | bomb & }; bomb; sleep 60", ws, limits)
    assert time.monotonic() - t0 < 10
    assert r.timed_out or not r.ok
    assert _procs_of_uid(sandbox_uid(ws)) == []
    # the machine still forks normally afterwards
    assert run_confined("echo alive", ws).output == b"alive\n"


def test_huge_output_is_truncated_and_the_flood_stopped(ws):
    limits = Limits(wall_s=10.0, output_bytes=1000, drain_bytes=100_000)
    t0 = time.monotonic()
    r = run_confined("yes gyre", ws, limits)
    assert len(r.output) == 1000 and r.truncated
    assert r.output.startswith(b"gyre\ngyre\n")
    assert not r.timed_out and r.returncode is None  # stopped as a flood, well before the wall clock
    assert time.monotonic() - t0 < 5


def test_huge_file_is_cut_at_the_file_size_limit(ws):
    r = run_confined("head -c 50000000 /dev/zero > big.bin", ws, Limits(file_size_mb=1))
    assert not r.ok
    assert (ws / "big.bin").stat().st_size <= 1024 * 1024


def test_memory_hog_hits_address_space_limit(ws):
    r = run_confined("python3 -c 'x = bytearray(2_000_000_000)'", ws, Limits(address_space_mb=256))
    assert not r.ok and b"MemoryError" in r.output


_AS_USER_SCRIPT = r'''
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from gyre_hpc.harness.confine import Limits, isolation_mode, run_confined
ws, open_dir = sys.argv[2], sys.argv[3]
print("mode", isolation_mode())
remount = "python3 -c 'import ctypes; print(\"remount\", ctypes.CDLL(None).mount(None, b\"/\", None, 32 | 4096, None))'"
r = run_confined("id -u; echo a > in.txt; echo b > ../esc.txt; echo c > " + open_dir + "/esc.txt; " + remount +
                 "; sleep 300 & setsid sleep 303 & true", ws, Limits(wall_s=5))
sys.stdout.write(r.output.decode())
'''


@needs_root
def test_non_root_user_gets_the_jail_through_a_user_namespace(tmp_path):
    """Run the harness side itself as an unprivileged user (as on a cluster) and escape-test."""
    if not (Path("/usr/bin/python3").exists() and shutil.which("setpriv")):
        pytest.skip("needs /usr/bin/python3 and setpriv to act as an unprivileged user")
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-userns-"))
    try:
        base.chmod(0o755)
        ws, open_dir = base / "ws", base / "open"
        ws.mkdir()
        open_dir.mkdir(mode=0o777)
        open_dir.chmod(0o777)
        os.chown(ws, 65534, 65534)
        repo = Path(__file__).resolve().parents[2]
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              "/usr/bin/python3", "-I", "-c", _AS_USER_SCRIPT, str(repo), str(ws), str(open_dir)],
                             capture_output=True, text=True, timeout=60)
        if "mode userns" not in out.stdout:
            pytest.skip(f"this kernel gives no user namespaces to unprivileged users: {out.stdout}{out.stderr}")
        assert "65534" in out.stdout.splitlines()[1]
        assert (ws / "in.txt").read_text() == "a\n"
        assert out.stdout.count("Read-only file system") + out.stdout.count("Directory nonexistent") == 2, out.stdout
        assert not (base / "esc.txt").exists() and list(open_dir.iterdir()) == []
        assert "remount -1" in out.stdout      # capabilities are gone after exec
        assert _procs_running(b"sleep\x00303") == []   # the PID namespace took the background sleeps
        assert _procs_running(b"sleep\x00300") == []
    finally:
        shutil.rmtree(base)


def test_command_that_closes_its_output_still_meets_the_wall_clock(ws):
    t0 = time.monotonic()
    secs = 100 + int.from_bytes(os.urandom(2), "little")   # unique: other checkouts run this test too
    r = run_confined(f"exec >/dev/null 2>&1; sleep {secs}", ws, Limits(wall_s=1.0))
    assert r.timed_out and time.monotonic() - t0 < 5
    assert _procs_running(b"sleep\x00%d" % secs) == []


needs_jail = pytest.mark.skipif(isolation_mode() == "plain",
                                reason="no namespaces for this user: plain mode cannot bound a setsid leftover")


@needs_jail
def test_a_pid1_that_calls_setsid_dies_at_the_wall_clock(ws):
    beat = ws / "beat"
    r = run_confined("exec python3 -c \"import os, time\nos.setsid()\nwhile True:\n"
                     "    open('beat', 'a').write('x')\n    time.sleep(0.05)\"", ws, Limits(wall_s=1.0))
    assert r.timed_out
    time.sleep(0.5)
    size = beat.stat().st_size
    time.sleep(1.0)
    assert beat.stat().st_size == size      # nothing of the jail writes any more
    if isolation_mode() == "root":
        assert _procs_of_uid(sandbox_uid(ws)) == []


@needs_jail
def test_double_fork_new_session_leftovers_die_with_the_jail(ws):
    r = run_confined("python3 -c \"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                     "        os.execvp('sleep', ['sleep', '3181'])\n    os._exit(0)\nos.wait()\"; exit 0", ws, Limits(wall_s=5.0))
    assert r.ok
    assert _procs_running(b"sleep\x003181") == []


def _unix_server(path: Path):
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    os.chmod(path, 0o777)
    s.listen(4)
    return s


@needs_jail
def test_no_host_unix_socket_abstract_socket_or_ipc_segment_is_reachable(ws):
    import ctypes
    import socket
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-sock-"))
    base.chmod(0o755)
    path_srv = _unix_server(base / "s")
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(b"\0gyre-test-abstract-%d" % os.getpid())
    abstract.listen(4)
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x6779_0000 + os.getpid() % 0xFFFF
    own_key = 0x5E00_0000 + int.from_bytes(os.urandom(2), "little")
    host_seg = libc.shmget(key, 4096, 0o1666)     # IPC_CREAT | 0666: any uid could attach it
    assert host_seg >= 0
    try:
        probe = ("import socket\nfor a in (%r, %r, '/run/munge/munge.socket.2'):\n"
                 "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(a)\n        print('REACHED', a)\n"
                 "    except OSError as e:\n        print('refused', e.errno)\n"
                 "import ctypes\nlibc = ctypes.CDLL(None)\nprint('host segment', libc.shmget(%d, 0, 0))\n"
                 "print('own segment', libc.shmget(%d, 4096, 0o1600))\n"
                 % (str(base / "s"), "\0gyre-test-abstract-%d" % os.getpid(), key, own_key))
        (ws / "probe.py").write_text(probe)
        r = run_confined("python3 probe.py", ws)
        assert b"REACHED" not in r.output and r.output.count(b"refused") == 3, r.output
        assert b"host segment -1" in r.output
        assert b"own segment -1" not in r.output
        # the jail's segment went with its IPC namespace
        host_keys = [int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
        assert key in host_keys and own_key not in host_keys
    finally:
        libc.shmctl(host_seg, 0, None)           # IPC_RMID
        path_srv.close()
        abstract.close()
        shutil.rmtree(base)


@needs_jail
def test_sibling_workspaces_and_journals_are_not_visible(tmp_path):
    run = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-run-"))
    try:
        run.chmod(0o755)
        (run / "workspaces" / "a").mkdir(parents=True)
        (run / "workspaces" / "b").mkdir(parents=True)
        (run / "workspaces" / "b" / "solution.py").write_text("SECRET = 1\n")
        (run / "journals").mkdir()
        (run / "journals" / "b.jsonl").write_text("{}\n")
        for d in (run, run / "workspaces", run / "workspaces" / "b", run / "journals"):
            d.chmod(0o755)
        r = run_confined(f"cat {run}/workspaces/b/solution.py {run}/journals/b.jsonl ../b/solution.py; "
                         f"ls {run} /run /var/run /tmp /home /root 2>&1; true", run / "workspaces" / "a")
        assert b"SECRET" not in r.output and b"{}" not in r.output and b"munge" not in r.output, r.output
        assert r.output.count(b"No such file or directory") == 8   # 3 files, 5 directories
    finally:
        shutil.rmtree(run)


@needs_root
def test_a_non_ascii_mount_point_stays_read_only(ws):
    import subprocess as sp
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-mnt-ü x-"))
    mnt = base / "naïve mount"
    mnt.mkdir()
    assert sp.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(mnt)]).returncode == 0
    try:
        r = run_confined(f"echo pwned > '{mnt}/f'; ls -d '{mnt}'", ws, Limits(host_paths=Limits().host_paths + (str(base),)))
        assert not (mnt / "f").exists(), r.output
        assert str(mnt).encode() in r.output             # it was visible, and read-only
    finally:
        sp.run(["umount", str(mnt)])
        shutil.rmtree(base)


def test_mountinfo_escapes_and_non_ascii_are_decoded():
    from gyre_hpc.harness.sandbox_exec import mounts_beneath, parse_mountinfo
    line = ("36 25 0:30 / /var/tmp/gyre-\u00fc\\040x/na\u00efve\\011tab rw,nosuid,relatime shared:1 - tmpfs tmpfs rw\n"
            "37 25 0:31 / /back\\134slash\\012nl ro,nodev - tmpfs tmpfs rw\n"
            "38 25 0:32 / /tmp/hidden rw - tmpfs tmpfs rw\n"         # under the old root's /tmp
            "40 25 0:33 / /tmp rw - tmpfs tmpfs rw\n"                # the new root
            "41 40 0:34 / /tmp/usr ro - ext4 /dev/vda ro\n"
            "42 41 0:35 / /tmp/usr/\u00fcber rw,nodev - tmpfs tmpfs rw\n").encode()
    parsed = parse_mountinfo(line)
    (_, _, p1, f1), (_, _, p2, f2) = parsed[:2]
    assert p1 == "/var/tmp/gyre-\u00fc x/na\u00efve\ttab" and p2 == "/back\\slash\nnl"
    assert f1 == 2 | 2097152 and f2 == 4 | 1        # nosuid|relatime; nodev|rdonly kept as they were
    assert mounts_beneath(parsed, "/tmp") == [("/", 0), ("/usr", 1), ("/usr/\u00fcber", 4)]


_ATTACKS_AS_USER = r'''
import os, sys, time
sys.path.insert(0, sys.argv[1])
from gyre_hpc.harness.confine import Limits, isolation_mode, run_confined
from gyre_hpc.harness.tasks import Task, TaskTest, check_workspace
from gyre_hpc.harness.tools import ToolError, Workspace
base = sys.argv[2]
ws = os.path.join(base, "ws")
print("mode", isolation_mode())
r = run_confined("exec python3 -c \"import os, time\nos.setsid()\nwhile True:\n    open('beat', 'a').write('x')\n"
                 "    time.sleep(0.05)\"", ws, Limits(wall_s=1.0))
time.sleep(0.5)
size = os.path.getsize(os.path.join(ws, "beat"))
time.sleep(1.0)
print("setsid", r.timed_out, os.path.getsize(os.path.join(ws, "beat")) == size)
r = run_confined("python3 -c \"import socket\nfor a in ('%s/s', '/run/munge/munge.socket.2'):\n"
                 "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(a); print('REACHED', a)\n"
                 "    except OSError: print('refused')\"; cat %s/sibling/secret.txt" % (base, base), ws)
sys.stdout.write(r.output.decode())
task = Task("add", "s", tests=(TaskTest("add", "import mathx\nassert mathx.add(2, 3) == 5"),))
open(os.path.join(ws, "mathx.py"), "w").write("import json, os, sys\nm = sys.modules['__main__']\n"
    "m.results.write(m.NONCE + json.dumps(['add', True, '']) + '\\n') if hasattr(m, 'NONCE') else None\nos._exit(0)\n")
print("forged score", check_workspace(task, ws).score)
try:
    Workspace(ws).read("out_link")
    print("READ OUTSIDE")
except ToolError:
    print("link blocked")
'''


@needs_root
def test_the_attacks_hold_when_the_harness_runs_as_an_unprivileged_user():
    """Re-run the new attacks with the harness itself as nobody (as on a cluster): the jail is
    then built in a user namespace, and must hold the same."""
    if not (Path("/usr/bin/python3").exists() and shutil.which("setpriv")):
        pytest.skip("needs /usr/bin/python3 and setpriv to act as an unprivileged user")
    import socket
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-userns-attacks-"))
    try:
        base.chmod(0o755)
        (base / "ws").mkdir()
        os.chown(base / "ws", 65534, 65534)
        (base / "sibling").mkdir()
        (base / "sibling" / "secret.txt").write_text("SIBLING-SECRET")
        (base / "sibling" / "secret.txt").chmod(0o644)
        os.symlink(base / "sibling" / "secret.txt", base / "ws" / "out_link")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(str(base / "s"))
        os.chmod(base / "s", 0o777)
        srv.listen(2)
        repo = Path(__file__).resolve().parents[2]
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              "/usr/bin/python3", "-I", "-c", _ATTACKS_AS_USER, str(repo), str(base)],
                             capture_output=True, text=True, timeout=120)
        srv.close()
        if "mode userns" not in out.stdout:
            pytest.skip(f"this kernel gives no user namespaces to unprivileged users: {out.stdout}{out.stderr}")
        assert "setsid True True" in out.stdout, out.stdout + out.stderr
        assert "REACHED" not in out.stdout and out.stdout.count("refused") == 2, out.stdout
        assert "SIBLING-SECRET" not in out.stdout
        assert "forged score 0.0" in out.stdout, out.stdout + out.stderr
        assert "link blocked" in out.stdout
    finally:
        shutil.rmtree(base)


def test_host_paths_that_would_undo_the_jail_are_refused():
    for bad in ("/", "/tmp", "/tmp/x", "/proc", "/dev/shm", "usr"):
        with pytest.raises(ValueError, match="Limits.host_paths"):
            Limits(host_paths=("/usr", bad))
    assert Limits(host_paths=("/usr", "/opt/python")).host_paths == ("/usr", "/opt/python")


_FAIL_CLOSED_AS_USER = r'''
import sys
sys.path.insert(0, sys.argv[1])
from gyre_hpc.harness.confine import Limits, isolation_mode, run_confined
print("mode", isolation_mode())
r = run_confined("echo RAN", sys.argv[2], Limits(host_paths=Limits().host_paths + (sys.argv[3],)))
print("rc", r.returncode)
sys.stdout.write(r.output.decode())
'''


@needs_root
def test_a_mount_that_cannot_be_made_read_only_fails_the_jail_closed():
    """As nobody, a mount under a root-only directory cannot be reached to remount it read-only
    (no DAC override for an unmapped owner): the jail must refuse to run, not run writable."""
    import subprocess as sp
    if not (Path("/usr/bin/python3").exists() and shutil.which("setpriv")):
        pytest.skip("needs /usr/bin/python3 and setpriv to act as an unprivileged user")
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-closed-"))
    mnt = base / "exposed" / "priv" / "mnt"
    mnt.mkdir(parents=True)
    for d in (base, base / "exposed"):
        d.chmod(0o755)
    (base / "exposed" / "priv").chmod(0o700)
    (base / "ws").mkdir()
    os.chown(base / "ws", 65534, 65534)
    assert sp.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(mnt)]).returncode == 0
    try:
        repo = Path(__file__).resolve().parents[2]
        out = sp.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I",
                      "-c", _FAIL_CLOSED_AS_USER, str(repo), str(base / "ws"), str(base / "exposed")],
                     capture_output=True, text=True, timeout=60)
        if "mode userns" not in out.stdout:
            pytest.skip(f"this kernel gives no user namespaces to unprivileged users: {out.stdout}{out.stderr}")
        assert "rc 125" in out.stdout and "jail setup failed" in out.stdout, out.stdout + out.stderr
        assert "RAN" not in out.stdout
    finally:
        sp.run(["umount", str(mnt)])
        shutil.rmtree(base)


def test_without_a_jail_model_commands_are_refused_naming_the_capability(ws, monkeypatch):
    """Plain mode (no root, no user namespaces) is never silently weaker: refused unless allowed."""
    from gyre_hpc.config import ConfigError, build_config
    from gyre_hpc.harness import confine
    from gyre_hpc.harness.loop import HarnessConfig
    from gyre_hpc.rl.preflight import check_config

    monkeypatch.setattr(confine, "isolation_mode", lambda: "plain")
    with pytest.raises(confine.ConfinementError, match=r"user namespace .*rollout.allow_unconfined"):
        run_confined("echo hi", ws)
    assert run_confined("echo hi", ws, Limits(allow_unconfined=True)).output == b"hi\n"
    cfg = build_config({"workload": "rl"})
    with pytest.raises(ConfigError, match=r"rollout.allow_unconfined=false: model-written commands need a jail"):
        check_config(cfg)
    allowed = build_config({"workload": "rl", "rollout": {"allow_unconfined": True}})
    check_config(allowed)
    h = HarnessConfig.from_rollout(allowed.rollout)
    assert h.command_limits.allow_unconfined and h.check_limits.allow_unconfined
    assert not HarnessConfig.from_rollout(cfg.rollout).command_limits.allow_unconfined
