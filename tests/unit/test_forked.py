"""`eagle_lib.forked.forked_map`: results in item order, computed in forked children, errors brought back."""

import os

import pytest

from eagle_lib import forked


def test_results_come_back_in_item_order_from_forked_children():
    parent = os.getpid()
    data = {"offset": 7}  # set before the call: a child sees the parent's memory as it is at the call

    got = forked.forked_map(lambda i: (i * i + data["offset"], os.getpid()), 9, 2)
    assert [v for v, _ in got] == [i * i + 7 for i in range(9)]
    assert parent not in {pid for _, pid in got}
    assert forked.forked_map(lambda i: os.getpid(), 3, 1) == [parent] * 3  # one process: this one


def test_a_childs_exception_is_raised_here_and_a_dead_child_is_named():
    def bad(i):
        if i == 3:
            raise ValueError(f"bad item {i}")
        return i

    with pytest.raises(ValueError, match="bad item 3"):
        forked.forked_map(bad, 6, 2)

    def dies(i):
        if i == 1:
            os._exit(3)
        return i

    with pytest.raises(RuntimeError, match="held-out decoding: a worker process died"):
        forked.forked_map(dies, 4, 2, "held-out decoding")
    assert forked.forked_map(lambda i: i, 4, 2) == [0, 1, 2, 3]  # usable again after a failure


def test_nested_calls_are_refused():
    with pytest.raises(RuntimeError, match="nested"):
        forked.forked_map(lambda i: forked.forked_map(lambda j: j, 2, 2), 2, 2)


def test_decoding_processes_follow_the_threads_held_the_cores_the_cap_and_stay_one_on_a_gpu(monkeypatch):
    from eagle_lib.engines import machine

    monkeypatch.setattr(machine, "usable_cores", lambda: 4)
    monkeypatch.delenv("EAGLE_MAX_THREADS", raising=False)
    got = [machine.decoding_processes(owned, per) for owned, per in ((4, 1), (2, 1), (4, 2), (1, 1), (8, 1))]
    assert got == [4, 2, 2, 1, 4]  # threads held // threads a decode, within the 4 cores
    assert machine.decoding_processes(4, 1, "cuda:0") == 1  # CUDA cannot run in a forked child
    monkeypatch.setenv("EAGLE_MAX_THREADS", "1")
    assert machine.decoding_processes(4, 1) == 1  # the suite's workers, a shared machine


def test_done_runs_here_once_per_item_as_each_ends():
    """`done(i, result)`: the progress lines of a long map. It runs in this process (it may print or keep state),
    once per item, with that item's result, whether the items ran here or in children."""
    for processes in (1, 2):
        seen: list = []

        def note(i, r, seen=seen):
            seen.append((i, r, os.getpid()))

        got = forked.forked_map(lambda i: i * 10, 5, processes, done=note)
        assert got == [0, 10, 20, 30, 40]
        assert sorted(seen) == [(i, i * 10, os.getpid()) for i in range(5)]
