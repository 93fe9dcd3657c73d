"""The launcher with stub ranks (`python -c ...`): how a failed rank is reported, what a stop
signal does, that nothing outlives the launcher, and which package the workers import."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from mmpipe.config import GROUPS
from mmpipe.runtime.launch import launch, worker_command
from mmpipe.runtime.worker import STOP, StopRequested

ROOT = Path(__file__).resolve().parents[3]


def stub(body: str) -> tuple[list[str], str]:
    """A rank command running `body` (with os, signal, sys, time, R = RANK imported), and the
    marker that finds its processes in `ps`."""
    marker = f"mmpipe-test-{uuid.uuid4().hex[:12]}"
    code = f"# {marker}\nimport os, signal, sys, time\nR = int(os.environ['RANK'])\n" + textwrap.dedent(body)
    return [sys.executable, "-c", code], marker


def alive(marker: str) -> list[str]:
    """Processes whose command line holds `marker`, after giving the dying a moment."""
    for _ in range(40):
        ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
        found = [l for l in ps.splitlines() if marker in l and " Z" not in l]
        if not found:
            return []
        time.sleep(0.05)
    return found


def test_a_dead_rank_is_named_with_its_signal_and_its_last_lines(tmp_path, capfd) -> None:
    argv, marker = stub("""
        print(f"rank {R} up", flush=True)
        if R == 1:
            for i in range(20):
                print(f"rank 1 says {i}", flush=True)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """)
    console = io.BytesIO()
    t0 = time.monotonic()
    code = launch(argv, nproc=3, log_dir=tmp_path, grace_s=5, console=console)
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert code == 128 + 9
    assert f"mmpipe train: error: rank 1 was killed by SIGKILL; stopped rank(s) 0, 2; the last lines of " \
           f"{tmp_path / 'rank1.log'}:" in err
    assert "  | rank 1 says 19" in err and "  | rank 1 says 7" not in err  # the tail, not everything
    assert console.getvalue() == b"rank 0 up\n"  # rank 0 alone reaches the console
    assert (tmp_path / "rank2.log").read_text() == "rank 2 up\n"
    assert took < 5 + 3, took  # the sleeping ranks took SIGTERM, no SIGKILL wait
    assert alive(marker) == []


def test_a_user_error_is_printed_once_for_the_job(tmp_path, capfd) -> None:
    argv, _ = stub("""
        from pathlib import Path
        Path(os.environ["MMPIPE_ERROR_FILE"]).write_text("x-0.tar sample k7: undecodable image: 9 bytes\\n")
        sys.exit(2)
    """)
    code = launch(argv, nproc=2, log_dir=tmp_path, grace_s=5, console=io.BytesIO())
    err = capfd.readouterr().err
    assert code == 2
    assert err.count("undecodable image") == 1
    assert err.strip() == "mmpipe train: error: x-0.tar sample k7: undecodable image: 9 bytes"
    assert "error: x-0.tar sample k7" in (tmp_path / "rank0.log").read_text() + (tmp_path / "rank1.log").read_text()


def test_a_full_disk_neither_blocks_a_rank_nor_loses_its_error_line(tmp_path, capfd, monkeypatch) -> None:
    """The run directory's disk is full: the launcher cannot write the rank logs and the rank
    cannot write its error file. The launcher keeps draining the rank's output (more than a pipe
    holds), and takes the rank's one line from its output instead."""
    import errno

    import mmpipe.runtime.launch as launch_module

    argv, _ = stub("""
        from mmpipe.runtime.worker import disk_error_line, report_error
        print("x" * 200_000, flush=True)  # more than a pipe holds
        if R == 1:
            os.environ["MMPIPE_ERROR_FILE"] = "/proc/no-such-folder/rank1.error"  # cannot be written
            sys.exit(report_error(OSError(28, "No space left on device", "/run/metrics.jsonl"),
                                  line=disk_error_line(OSError(28, "No space left on device", "/run/metrics.jsonl"))))
        time.sleep(60)
    """)
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, _data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *_):
            self.f.close()

    def full_logs(path, mode="r", **kwargs):
        f = real_open(path, mode, **kwargs)
        return FullDisk(f) if str(path).endswith(".log") else f

    monkeypatch.setattr(launch_module, "open", full_logs, raising=False)
    code = launch(argv, nproc=2, log_dir=tmp_path, grace_s=5, console=io.BytesIO(), timeout_s=60)
    err = capfd.readouterr().err
    assert code == 2
    assert err.strip() == ("mmpipe train: error: cannot write /run/metrics.jsonl: No space left on device; free space "
                           "on that disk, or train in a run directory on another (hydra.run.dir=DIR)")


def test_a_rank_that_only_lost_its_peer_is_not_blamed(tmp_path, capfd) -> None:
    # Rank 0 fails in a collective because rank 1 vanished (status 3); the report names rank 1.
    argv, _ = stub("""
        from pathlib import Path
        if R == 0:
            Path(os.environ["MMPIPE_ERROR_FILE"]).write_text("rank 0 lost contact with another rank\\n")
            sys.exit(3)
        time.sleep(0.5)  # the cause ends after the symptom: the launcher waits for it
        print("Traceback: the real failure", flush=True)
        sys.exit(1)
    """)
    code = launch(argv, nproc=2, log_dir=tmp_path, grace_s=5, console=io.BytesIO())
    err = capfd.readouterr().err
    assert code == 1, err
    assert "rank 1 exited with status 1" in err and "the real failure" in err and "lost contact" not in err


LAUNCHER = """
import sys
sys.path[0] = {root!r}
from mmpipe.runtime.launch import launch
sys.exit(launch({argv!r}, nproc=2, log_dir={logs!r}, grace_s=1.5))
"""


def wait_ready(proc: subprocess.Popen, logs: Path) -> None:
    """Until both stub ranks have said `ready` in their logs."""
    deadline = time.monotonic() + 60
    while not all((logs / f"rank{r}.log").is_file() and "ready" in (logs / f"rank{r}.log").read_text()
                  for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])  # SIGHUP takes the same path
def test_a_stop_signal_reaches_every_rank_and_leaves_no_process(tmp_path, sig) -> None:
    # Rank 0 exits on SIGTERM; rank 1 notes it and carries on, so the launcher must SIGKILL it.
    argv, marker = stub(f"""
        def note(signum, frame):
            open(os.path.join({str(tmp_path)!r}, f"rank{{R}}.got{{signum}}"), "w").close()
            if R == 0:
                sys.exit(143)
        signal.signal(signal.SIGTERM, note)
        print("ready", flush=True)
        time.sleep(120)
    """)
    logs = str(tmp_path / "logs")
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(root=str(ROOT), argv=argv, logs=logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_ready(proc, Path(logs))
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + int(sig), err
    assert f"mmpipe train: got {sig.name}; stopping 2 rank(s)" in err and f"mmpipe train: stopped by {sig.name}" in err
    # every rank got SIGTERM (whatever the launcher got), and none is left
    assert sorted(p.name for p in tmp_path.glob("rank*.got*")) == [f"rank0.got{int(signal.SIGTERM)}",
                                                                 f"rank1.got{int(signal.SIGTERM)}"]
    assert alive(marker) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_killed_launcher(tmp_path) -> None:
    argv, marker = stub("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(120)
    """)
    logs = str(tmp_path / "logs")
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(root=str(ROOT), argv=argv, logs=logs)])
    wait_ready(proc, Path(logs))
    proc.kill()
    proc.wait()
    assert alive(marker) == []


def test_workers_import_the_launchers_package_not_the_current_directory(tmp_path) -> None:
    # A folder holding a mmpipe/ checkout and a yaml.py: `python -m mmpipe.runtime.worker` run
    # there would import both. The worker must run the launcher's mmpipe and the real yaml.
    (tmp_path / "mmpipe").mkdir()
    (tmp_path / "mmpipe" / "__init__.py").write_text("raise ImportError('the mmpipe/ in the current directory')\n")
    (tmp_path / "yaml.py").write_text("raise ImportError('the yaml.py in the current directory')\n")
    (tmp_path / "run.yaml").write_text("bogus: 1\n")  # read by the worker: a config error it reports
    code = f"""
import sys
sys.path[0] = {str(ROOT)!r}
from mmpipe.runtime.launch import launch, worker_command
sys.exit(launch(worker_command("run.yaml"), nproc=1, log_dir="logs", grace_s=1))
"""
    env = dict(os.environ, MMPIPE_DEBUG="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "current directory" not in log + proc.stderr
    assert proc.returncode == 2, proc.stderr + log
    assert proc.stderr.strip().endswith("mmpipe train: error: bogus is not a config group; known: "
                                        + ", ".join(GROUPS))
    assert f'File "{ROOT / "mmpipe" / "config.py"}"' in log  # MMPIPE_DEBUG=1: the traceback, from our package
    assert worker_command("x")[-1] == "x"


def test_the_stop_signal_is_deferred_to_where_the_loop_checks_it() -> None:
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        STOP.install()
        with pytest.raises(StopRequested, match="stopped by SIGTERM"):
            with STOP.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run: it only noted the request
                assert STOP.requested == signal.SIGTERM
                checked = True
        assert checked
        with pytest.raises(StopRequested, match="stopped by SIGHUP"):  # not deferred: at once
            STOP.requested = None
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)
    finally:
        STOP.requested = None
        for s, h in old.items():
            signal.signal(s, h)
