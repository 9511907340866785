"""Smaller versions of ``conveyor bench overload`` and ``conveyor bench soak`` against a real
server: nothing but intended errors, every KV page back, resident memory levelled off."""

from __future__ import annotations

import asyncio

import pytest
from server_process import ServerProcess, running_server

from conveyor.bench.stress import (rss_mib, run_overload, run_soak, server_state, summary,
                                   write_kv_pool)


@pytest.fixture(scope="module")
def server():
    with running_server("--max-num-seqs", "4", "--max-queue-len", "8") as proc:
        yield proc


def idle_and_whole(server: ServerProcess):
    after = server_state(server.base_url, {}, server.proc.pid)
    assert (after.running, after.waiting, after.pages_in_use, after.health) == (0, 0, 0, 200)
    return after


@pytest.mark.slow
def test_overload_each_stream_completes_or_is_refused(server):
    result = summary(asyncio.run(run_overload(server.base_url, {}, 100, 8)))
    assert result["failures"] == [] and set(result["outcomes"]) == {"completed", "refused"}
    assert result["outcomes"]["completed"] >= 4
    assert set(result["refused_by_code"]) <= {"429", "503"}
    idle_and_whole(server)


@pytest.mark.slow
def test_soak_with_disconnects_and_bad_requests_loses_nothing(server, capsys):
    rss = {}
    write_kv_pool(server.base_url, {})  # (the pool is mapped lazily)
    outcomes = asyncio.run(run_soak(
        server.base_url, {}, 150, 8, 0.10, 0.05, 8, 0, 50,
        lambda: rss.setdefault("checkpoint", rss_mib(server.proc.pid))))
    shown = capsys.readouterr().err  # progress bars, with their totals
    assert "writing every KV page once: 100%" in shown and "soak: 100%" in shown
    assert "150/150" in shown
    result = summary(outcomes)
    assert result["failures"] == [], result
    assert {"completed", "disconnected", "rejected"} <= set(result["outcomes"])
    assert set(result["rejected_by_code"]) <= {"400", "404", "413"}
    after = idle_and_whole(server)
    assert after.rss_mib < 1.05 * rss["checkpoint"], (rss, after.rss_mib)
    assert "Traceback" not in server.log() and " ERROR " not in server.log()
