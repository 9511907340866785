"""The thread governor: as many threads as the cores other processes leave, between one and
the configured count, read from the machine's CPU times (scripted here)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conveyor.worker import cpu_share
from conveyor.worker.cpu_share import CpuTimes, ThreadGovernor, threads_for


@given(limit=st.integers(1, 64), cpus=st.integers(1, 64),
       a=st.floats(0, 80, allow_nan=False), b=st.floats(0, 80, allow_nan=False))
def test_threads_stay_in_range_and_fall_as_others_take_more(limit, cpus, a, b):
    low, high = sorted((a, b))
    assert 1 <= threads_for(limit, cpus, high) <= threads_for(limit, cpus, low) <= limit


@pytest.mark.parametrize("others,expected", [(0.0, 2), (0.05, 2), (0.4, 1), (1.0, 1), (2.0, 1)])
def test_two_cores_and_another_process(others, expected):
    assert threads_for(2, 2, others) == expected
    assert threads_for(1, 2, others) == 1
    assert threads_for(8, 8, others) == 8 - (others > 0.3) - (others > 1.3)


@pytest.fixture
def machine(monkeypatch):
    """A scripted machine: feed(seconds, others_cores, own_cores) advances its clock and its
    CPU times as if they were busy at those rates."""
    state = {"now": 100.0, "busy": 0.0, "own": 0.0}

    def feed(seconds: float, others: float, own: float) -> None:
        state["now"] += seconds
        state["busy"] += (others + own) * seconds
        state["own"] += own * seconds

    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: state["now"])
    monkeypatch.setattr(CpuTimes, "read", staticmethod(
        lambda: CpuTimes(state["busy"], state["own"])))
    before = torch.get_num_threads()
    yield feed
    torch.set_num_threads(before)


def test_the_governor_gives_a_core_back_and_takes_it_again(machine, monkeypatch):
    monkeypatch.setattr(cpu_share, "_unlowered", None)
    torch.set_num_threads(2)  # (the process's count before any governor, whatever the worker's)
    gov = ThreadGovernor(limit=2)
    gov.cpus = 2
    machine(0.1, others=1.0, own=2.0)
    assert gov.update() == 2  # not an interval yet: no reading
    machine(0.5, others=0.7, own=1.3)  # a busy loop beside two threads gets 2/3 of a core
    assert gov.update() == 1 and torch.get_num_threads() == 1
    assert cpu_share.default_threads() == 2  # the next engine starts from the real default
    machine(0.6, others=1.0, own=1.0)
    assert gov.update() == 1
    machine(0.6, others=0.02, own=1.0)  # the other process ended
    assert gov.update() == 2 and torch.get_num_threads() == 2
    machine(0.6, others=1.0, own=2.0)
    assert gov.update() == 1
    gov.close()
    assert torch.get_num_threads() == 2


def test_without_proc_the_count_never_changes(monkeypatch):
    monkeypatch.setattr(CpuTimes, "read", staticmethod(lambda: None))
    gov = ThreadGovernor(limit=3)
    assert gov.update() == 3 and gov.update() == 3


def test_cpu_times_read_this_machine():
    times = CpuTimes.read()
    if times is None:
        pytest.skip("no /proc here")
    sum(i * i for i in range(200_000))  # some CPU time of our own
    later = CpuTimes.read()
    assert 0 <= times.own <= later.own and 0 < times.machine_busy <= later.machine_busy
    assert later.own - times.own <= later.machine_busy - times.machine_busy + 0.05
