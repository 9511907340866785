"""Checks the engine tests share."""

from __future__ import annotations

from conveyor import LLM


def assert_no_leak(llm: LLM) -> None:
    """Every KV page is back in the pool and no request is left."""
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not llm.engine.has_unfinished_requests()


def assert_allowed(matcher, token_ids: list[int]) -> None:
    """A fresh constraint matcher takes every one of these tokens (a cut output: a prefix the
    constraint allows)."""
    assert matcher.validate_tokens(token_ids) == len(token_ids), token_ids
