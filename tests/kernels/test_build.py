"""The kernels' build (kernels/build.py): a first start says that it compiles, while it
compiles, and when it is done; a cached library is loaded without a word."""

from __future__ import annotations

import logging

import pytest

from conveyor.kernels import build, isa

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def test_a_first_build_says_so_and_a_cached_one_does_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # a few of the generic tier's sources (a library need not resolve every symbol to link)
    sources = [p for p in build.tier_sources("generic") if p.parent.name == "generic"][:4]
    monkeypatch.setattr(build, "tier_sources", lambda tier: sources)
    monkeypatch.setattr(build, "PROGRESS_SECONDS", 0.2)
    with caplog.at_level(logging.INFO, logger="conveyor"):
        first = build.build("generic", isa.current(), build.compiler())
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("compiling the CPU kernels for the generic tier, once")
    assert f"({len(sources)} sources on {build._jobs()} cores; cached in {tmp_path}" in said[0]
    assert any("sources done" in line for line in said[1:-1]), said
    assert said[-1].startswith("compiled the CPU kernels for the generic tier in")
    assert first.exists() and first.is_relative_to(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="conveyor"):
        assert build.build("generic", isa.current(), build.compiler()) == first
    assert not caplog.records
