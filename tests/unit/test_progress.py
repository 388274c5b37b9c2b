"""eagle_lib.progress: the ETA, the rate limit, the pipeline's console file; eagle_lib.console's tail."""

import os

import pytest

from eagle_lib import progress
from eagle_lib.console import ConsoleTail


class Clock:
    """A fake clock the test moves by hand."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_eta_from_a_known_rate():
    """Units that take 2 s each: after 30 of 100 (60 s), 70 remain -> 140 s; a resumed run (10 done before,
    20 since in 40 s) -> the same 2 s a unit."""
    clock = Clock()
    p = progress.Progress("step", 100, clock=clock, echo=False)
    clock.t += 30 * 2.0
    assert p.line(30).endswith("elapsed 1m00s, ETA 2m20s")
    r = progress.Progress("step", 100, start=10, clock=clock, echo=False)
    clock.t += 20 * 2.0
    assert r.line(30).endswith("elapsed 40s, ETA 2m20s")
    assert progress.eta_seconds(5.0, 0, 10) is None  # nothing done: no rate yet
    assert progress.eta_seconds(7.0, 10, 10) == 0


def test_counter_counts_each_ended_item_with_its_note():
    """`counter`: the done callback of a forked map; items end in any order, each one more unit (after `start`),
    the line's note from the item; 4 s a unit -> the ETA of what is left."""
    clock = Clock()
    p = progress.Progress("prompt", 5, every_s=0, start=1, clock=clock, echo=False)
    shown: list[str] = []
    p.emit = shown.append
    done = p.counter(lambda i: f"item {i}")
    for i in (3, 0):
        clock.t += 4.0
        done(i, None)
    assert shown == ["prompt 2/5, item 3, elapsed 4s, ETA 12s", "prompt 3/5, item 0, elapsed 8s, ETA 8s"]


def test_eta_with_two_rates_is_the_mean_rate():
    """10 units at 1 s then 10 at 3 s: 40 s for 20 units, the mean 2 s a unit over the 30 left -> 60 s."""
    clock = Clock()
    p = progress.Progress("arm", 50, clock=clock, echo=False)
    clock.t += 10 * 1.0 + 10 * 3.0
    assert p.line(20) == "arm 20/50, elapsed 40s, ETA 1m00s"


@pytest.mark.parametrize(
    ("s", "text"), [(None, "?"), (0, "0s"), (59.4, "59s"), (61, "1m01s"), (3725, "1h02m")]
)
def test_duration(s, text):
    assert progress.duration(s) == text


def test_rate_limited_lines_on_stdout_and_console(tmp_path, monkeypatch, capsys):
    """First unit, then at most one line per every_s, then the last; each printed line also reaches the
    console file the pipeline names."""
    console = tmp_path / "c.txt"
    monkeypatch.setenv(progress.CONSOLE_ENV, str(console))
    clock = Clock()
    p = progress.Progress("prompt", 10, unit="prompts", every_s=15, clock=clock)
    shown = []
    for done in range(1, 11):  # a unit every 4 s: a line at 4 s, every 16 s after (15 s), then the last
        clock.t += 4.0
        if p.update(done, "x"):
            shown.append(done)
    assert shown == [1, 5, 9, 10]
    out = capsys.readouterr().out.splitlines()
    assert out == console.read_text().splitlines()
    assert out[0] == "prompt 1/10 prompts, x, elapsed 4s, ETA 36s"
    assert out[-1] == "prompt 10/10 prompts, x, elapsed 40s, ETA 0s"


def test_no_console_file_without_the_pipeline(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(progress.CONSOLE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    progress.Progress("step", 2, every_s=0).update(1)
    assert capsys.readouterr().out.startswith("step 1/2, elapsed")
    assert list(tmp_path.iterdir()) == []


def test_bar_is_tqdm_shaped_and_reports_a_stop(capsys):
    clock = Clock()
    bar = progress.Bar(progress.Progress("d", 5, every_s=100, clock=clock))
    clock.t += 2.0
    bar.update(1)
    bar.set_postfix_str("9 tok/s")
    clock.t += 2.0
    bar.update(1)  # not due
    bar.close()  # stopped at 2 of 5: the last count is shown
    assert capsys.readouterr().out.splitlines() == [
        "d 1/5, elapsed 2s, ETA 8s",
        "d 2/5, 9 tok/s (stopped), elapsed 4s, ETA 6s",
    ]
    off = progress.Bar(progress.Progress("d", 5), enabled=False)
    off.update(5)
    off.close()
    assert capsys.readouterr().out == ""


def test_tail_shows_whole_lines_and_the_rest_on_close(tmp_path):
    path, seen = tmp_path / "c.txt", []
    with ConsoleTail(path, seen.append, poll_s=0.01) as tail:
        with path.open("a") as f:
            f.write("one\ntw")
            f.flush()
            tail.read()
            assert seen == ["one"]  # "tw" waits for its newline
            f.write("o\nthree\n")
    assert seen == ["one", "two", "three"]


def test_socket_dir_stays_within_the_unix_socket_path_limit(tmp_path, monkeypatch):
    """A $TMPDIR too long for a Unix socket path (107 bytes) falls back to /tmp; the directory is private."""
    import os
    import shutil
    import tempfile

    from eagle_lib import console

    long_tmp = tmp_path / ("x" * 100)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    d = console.socket_dir()
    try:
        assert d.startswith("/tmp/eagle-k-") and len(os.path.join(d, "kernel-ipc-5")) <= 107
        assert os.stat(d).st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(d)


def test_stage_kernels_sleep_idle_openmp_threads_and_vllm_keeps_its_default(monkeypatch):
    """The runner starts each stage kernel with OMP_WAIT_POLICY=PASSIVE unless the user set a policy (a 2-thread
    stage beside another job collapsed with libgomp's spinning default: benchmarks/bench_threads.py), and the vLLM
    processes a stage starts do not inherit it."""
    from eagle_lib.console import report_env
    from eagle_lib.engines.vllm_server import server_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with report_env():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        env = server_env({"OMP_NUM_THREADS": "2"})
        assert "OMP_WAIT_POLICY" not in env and env["OMP_NUM_THREADS"] == "2"
    assert "OMP_WAIT_POLICY" not in os.environ  # restored after the stage
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with report_env():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
