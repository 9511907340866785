"""Data parallel: two engine replicas behind one front, over real HTTP through the official
client. Greedy float32 answers equal one engine's (both policies, preemption forced); requests
go to the replica with the fewest waiting tokens or the one holding their prefix; /metrics is
labelled per replica; a replica that dies takes the front down."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.cli import build_parser
from conveyor.config import EngineConfig
from conveyor.server.config import ServerConfig
from conveyor.server.data_parallel.front import replica_flags
from conveyor.server.data_parallel.router import PREFIX_BLOCKS, Router, page_hashes
from conveyor.settings import from_namespace

from server_process import child_pids, running_server
from test_equivalence import random_prompts, run_conveyor
from tiny_models import make_tiny_checkpoint

# The equivalence tests' engine: a pool small enough to preempt, prompts prefilled in chunks.
ENGINE = ["--dtype", "float32", "--block-size", "16", "--num-kv-blocks", "20",
          "--max-model-len", "160", "--max-num-seqs", "12", "--max-num-batched-tokens", "64"]
NEW_TOKENS = 40


# -- routing -----------------------------------------------------------------------------------
def test_fewest_waiting_tokens_first():
    router = Router(2, block_size=4)
    assert router.choose(list(range(100, 110))) == (0, 0)
    assert router.choose(list(range(200, 203))) == (1, 0)   # replica 0 has 10 waiting
    assert router.choose(list(range(300, 302))) == (1, 0)   # 3 < 10
    router.started(0, 10)                                   # replica 0's request answers
    assert router.choose(list(range(400, 405))) == (0, 0)


def test_a_held_prefix_outweighs_its_length_in_waiting_tokens():
    router = Router(2, block_size=4)
    shared = list(range(1000, 1012))                        # 3 pages
    assert router.choose(shared + [1, 2]) == (0, 0)
    assert router.choose([7] * 6) == (1, 0)                 # 14 vs 0 waiting
    # replica 0: 14 waiting - 12 held = 2 < replica 1's 6
    assert router.choose(shared + [3, 4, 5]) == (0, 12)
    assert router.choose(list(range(50, 90))) == (1, 0)     # no pages held: fewest waiting


def test_page_hashes_chain_and_the_memory_is_bounded():
    a, b = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), page_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # the same page after another prefix is another page
    assert page_hashes([1, 2, 3], 4) == []
    router = Router(1, block_size=1)
    router.choose(list(range(PREFIX_BLOCKS + 10)))
    assert len(router.replicas[0].pages) == PREFIX_BLOCKS


def test_replicas_get_the_front_s_settings_but_its_own():
    """A replica's flags, parsed by ``conveyor serve``, give back the front's settings: one
    replica, on loopback, the threads it was given unless the front's say."""
    engine = EngineConfig(model="m", data_parallel_size=2, policy="static", device="cpu",
                          enable_prefix_caching=False, kv_cache_memory="1GiB")
    server = ServerConfig(host="0.0.0.0", port=80, api_key="k", served_model_name=["a", "b"],
                          request_timeout=2.5, dashboard_public=True)
    parsed = build_parser().parse_args(["serve", *replica_flags(engine, server, threads=1)])
    assert from_namespace(EngineConfig, parsed) == replace(engine, data_parallel_size=1,
                                                           threads=1)
    assert from_namespace(ServerConfig, parsed) == replace(server, host="127.0.0.1", port=8000)
    own = replica_flags(replace(engine, threads=3), server, threads=1)
    assert from_namespace(EngineConfig, build_parser().parse_args(["serve", *own])).threads == 3


# -- two replicas behind the front -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-dp"), "llama")


@pytest.fixture(scope="module")
def one_engine(tiny_llama) -> list[str]:
    """The texts one in-process engine gives the prompts."""
    outputs = run_conveyor(tiny_llama, random_prompts(256), "continuous")
    return [o.outputs[0].text for o in outputs]


def per_replica(server, name: str) -> dict[str, float]:
    """A metric's samples summed by replica label."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                values[s.labels["replica"]] = values.get(s.labels["replica"], 0) + s.value
    return values


async def complete_all(server, model: str, prompts: list[list[int]]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0)
    try:
        outs = await asyncio.gather(*(client.completions.create(
            model=model, prompt=p, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}) for p in prompts))
    finally:
        await client.close()
    return [o.choices[0].text for o in outs]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_two_replicas_answer_as_one_engine(tiny_llama, one_engine, policy):
    """(The continuous policy's server then checks prefix routing and a replica's death.)"""
    with running_server("--model", tiny_llama, *ENGINE, "--policy", policy, "-dp", "2") as srv:
        version = httpx.get(f"{srv.base_url}/version").json()
        assert version["data_parallel_size"] == 2
        model = httpx.get(f"{srv.base_url}/v1/models").json()["data"][0]["id"]
        texts = asyncio.run(complete_all(srv, model, random_prompts(256)))
        assert texts == one_engine
        served = per_replica(srv, "conveyor:request_success_total")
        assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
        assert sum(served.values()) == len(texts)
        assert sum(per_replica(srv, "conveyor:num_preemptions_total").values()) > 0
        routed = per_replica(srv, "conveyor:dp_routed_requests_total")
        assert routed == served
        if policy == "continuous":
            shared_prefix_goes_where_its_pages_are(srv, model, routed)
            a_dead_replica_ends_the_front(srv)


def shared_prefix_goes_where_its_pages_are(srv, model: str, routed: dict[str, float]) -> None:
    prefix = list(range(500, 548))  # 3 pages
    hits = per_replica(srv, "conveyor:prefix_cache_hits_total")
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
    for tail in ([1], [2, 3], [4]):  # one at a time: no waiting tokens anywhere
        client.completions.create(model=model, prompt=prefix + tail, max_tokens=2)
    # the first went by load (a tie: to replica 0), the next two to its pages
    now = per_replica(srv, "conveyor:dp_routed_requests_total")
    assert {k: now[k] - routed.get(k, 0) for k in now} == {"0": 3, "1": 0}
    after = per_replica(srv, "conveyor:prefix_cache_hits_total")
    assert after["0"] - hits.get("0", 0) >= 2 * 48 and after["1"] == hits.get("1", 0)


def a_dead_replica_ends_the_front(srv) -> None:
    replica = child_pids(srv.proc.pid, "conveyor.cli")[0]
    os.kill(replica, signal.SIGKILL)
    assert srv.proc.wait(30) == 1, srv.log()[-3000:]
    assert "data-parallel replica" in srv.log() and "exited with -9" in srv.log()
