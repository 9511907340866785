"""Data parallel: two engine replicas behind one front, over real HTTP through the official
client. Greedy float32 answers equal one engine's (both policies, preemption forced); requests
go to the replica with the fewest waiting tokens or the one holding their prefix; /metrics is
labelled per replica; a replica that dies takes the front down. Replicas by URL
(``--replica-url``, already running servers) join local ones: checked at start, skipped while
out of reach and polled until they answer again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from cli_output import error_lines
from conveyor.cli import build_parser
from conveyor.config import EngineConfig
from conveyor.server.config import ServerConfig
from conveyor.process import free_port
from conveyor.server.data_parallel import front
from conveyor.server.data_parallel.front import (Replica, build_front, check_url_replica,
                                                 local_replica_count, replica_flags)
from conveyor.server.data_parallel.router import (PREFIX_BLOCKS, NoReplicaUp, Router,
                                                  page_hashes)
from conveyor.settings import from_namespace

from server_process import child_pids, running_server
from equivalence import random_prompts, run_conveyor
from tiny_models import make_tiny_checkpoint

# The equivalence tests' engine: a pool small enough to preempt, prompts prefilled in chunks.
# (run_conveyor's settings: transformers' numerics)
ENGINE = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--block-size", "16",
          "--num-kv-blocks", "20", "--max-model-len", "160", "--max-num-seqs", "12",
          "--max-num-batched-tokens", "64"]
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
                          request_timeout=2.5, dashboard_public=True,
                          replica_url=["http://10.0.0.2:8000"])
    parsed = build_parser().parse_args(["serve", *replica_flags(engine, server, threads=1)])
    assert from_namespace(EngineConfig, parsed) == replace(engine, data_parallel_size=1,
                                                           threads=1)
    assert from_namespace(ServerConfig, parsed) == replace(server, host="127.0.0.1", port=8000,
                                                           replica_url=None)
    own = replica_flags(replace(engine, threads=3), server, threads=1)
    assert from_namespace(EngineConfig, build_parser().parse_args(["serve", *own])).threads == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["choose", "answer", "down", "up"]),
                          st.integers(0, 2), st.lists(st.integers(0, 3), max_size=10)),
                max_size=40))
def test_routing_takes_the_best_replica_up_and_accounts_every_request(ops):
    """Down replicas take nothing and forget their pages; among those up the lowest score
    wins; none up raises; a withdrawn request (it never got there) leaves no count behind."""
    router, sent = Router(3, block_size=2), []
    for op, i, prompt in ops:
        if op == "down":
            router.mark_down(i)
            assert not router.replicas[i].pages
        elif op == "up":
            router.mark_up(i)
        elif op == "answer" and sent:
            replica, n = sent.pop(i % len(sent))
            router.started(replica, n)
            router.finished(replica)
        elif op == "choose":
            up = [j for j, r in enumerate(router.replicas) if r.up]
            if not up:
                with pytest.raises(NoReplicaUp):
                    router.choose(prompt)
                continue
            hashes = page_hashes(prompt, 2)
            held = {j: router.replicas[j].held_pages(hashes) * 2 for j in up}
            best = min(up, key=lambda j: (router.replicas[j].waiting_tokens - held[j],
                                          router.replicas[j].open_requests, j))
            assert router.choose(prompt) == (best, held[best])
            if i == 0:  # it could not connect
                router.withdraw(best, len(prompt))
            else:
                sent.append((best, len(prompt)))
    for replica, n in sent:
        router.started(replica, n)
        router.finished(replica)
    assert all(r.waiting_tokens == 0 and r.open_requests == 0 for r in router.replicas)


def test_data_parallel_size_counts_the_url_replicas_too():
    assert local_replica_count(3, []) == 3
    assert local_replica_count(1, ["u"]) == 0 and local_replica_count(1, ["u", "v"]) == 0
    assert local_replica_count(2, ["u"]) == 1 and local_replica_count(2, ["u", "v"]) == 0
    with pytest.raises(ValueError, match="counts every replica"):
        local_replica_count(2, ["u", "v", "w"])


def test_replica_url_is_repeatable_and_checked():
    args = build_parser().parse_args(["serve", "--replica-url", "http://a:1", "--replica-url",
                                      "https://b.example:8000/", "http://c:3"])
    assert from_namespace(ServerConfig, args).replica_url == [
        "http://a:1", "https://b.example:8000", "http://c:3"]
    for bad in ("a:1", "http://a:1/v1", "ftp://a"):
        with pytest.raises(ValueError, match="--replica-url must be http://HOST:PORT"):
            ServerConfig(replica_url=[bad])


class StubReplica:
    """A replica stand-in on a loopback port, serving model ``tiny``: /health, /v1/models,
    /metrics (its requests) and any POST (answered with its name); it can stop and start again
    on the same port."""

    def __init__(self, name: str) -> None:
        self.name, self.port, self.requests = name, free_port(), 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self.reply(json.dumps({"object": "list", "data": [{"id": "tiny"}]}))
                elif self.path == "/metrics":
                    self.reply("# TYPE conveyor:request_success counter\n"
                               f"conveyor:request_success_total {stub.requests}\n")
                else:
                    self.reply("")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                stub.requests += 1
                self.reply(json.dumps({"replica": stub.name}))

            def reply(self, text: str) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(text.encode())))
                self.end_headers()
                self.wfile.write(text.encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def front_metric(client: TestClient, name: str) -> dict[str, float]:
    return {s.labels["replica"]: s.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for s in family.samples if s.name == name}


def test_a_url_replica_out_of_reach_is_skipped_until_it_answers_again(monkeypatch):
    monkeypatch.setattr(front, "POLL_S", 0.05)
    a, b = StubReplica("a"), StubReplica("b")
    router = Router(2, block_size=4)
    app = build_front([Replica(a.url), Replica(b.url)], router, None, lambda: None)
    with TestClient(app) as client:
        def complete():
            return client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3]})

        assert complete().json() == {"replica": "a"}        # a tie: the first
        a.stop()
        assert complete().json() == {"replica": "b"}        # a refused it: b took it
        health = client.get("/health")
        assert health.status_code == 200
        assert [(r["replica"], r["healthy"]) for r in health.json()["replicas"]] == [
            ("0", False), ("1", True)]
        assert front_metric(client, "conveyor:dp_replica_up") == {"0": 0, "1": 1}
        assert front_metric(client, "conveyor:request_success_total") == {"1": 1}
        assert front_metric(client, "conveyor:dp_routed_requests_total") == {"0": 1, "1": 1}
        assert complete().json() == {"replica": "b"}
        a.start()
        deadline = time.monotonic() + 10
        while not router.replicas[0].up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert complete().json() == {"replica": "a"}        # polled: back in the routing
        a.stop()
        b.stop()
        for resp in (complete(), client.get("/v1/models"), client.get("/health")):
            assert resp.status_code == 503
            assert "no data-parallel replica is" in resp.json()["error"]["message"]
        assert all(r.waiting_tokens == 0 and r.open_requests == 0 for r in router.replicas)


def test_a_url_replica_is_checked_for_the_front_s_model():
    stub = StubReplica("a")
    try:
        check_url_replica(stub.url, ["tiny"], None)
        with pytest.raises(ValueError, match=f"{stub.url} serves tiny, not other"):
            check_url_replica(stub.url, ["tiny", "other"], None)
    finally:
        stub.stop()
    with pytest.raises(ValueError, match="does not answer"):
        check_url_replica(stub.url, ["tiny"], None)


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


def test_two_replicas_answer_as_one_engine(tiny_llama, one_engine):
    """(The server then checks prefix routing and a replica's death. The front routes alike
    under either policy: the static one is each engine's own, tested with the engine.)"""
    with running_server("--model", tiny_llama, *ENGINE, "-dp", "2") as srv:
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


# -- a local replica and one by URL behind the front -------------------------------------------
@pytest.fixture(scope="module")
def url_replica(tiny_llama):
    """An ordinary server: the front's replica by URL."""
    with running_server("--model", tiny_llama, *ENGINE) as srv:
        yield srv


def test_a_local_and_a_url_replica_answer_as_the_replica_does(tiny_llama, url_replica):
    model = httpx.get(f"{url_replica.base_url}/v1/models").json()["data"][0]["id"]
    prompts = random_prompts(256)[:6]
    own = asyncio.run(complete_all(url_replica, model, prompts))
    with running_server("--model", tiny_llama, *ENGINE, "-dp", "2", "--replica-url",
                        url_replica.base_url) as srv:
        assert httpx.get(f"{srv.base_url}/version").json()["data_parallel_size"] == 2
        assert asyncio.run(complete_all(srv, model, prompts)) == own
        routed = per_replica(srv, "conveyor:dp_routed_requests_total")
        served = per_replica(srv, "conveyor:request_success_total")
        assert set(routed) == {"0", "1"} and all(v > 0 for v in routed.values()), routed
        # replica 1 is the URL one: its own series, with the requests sent to it directly
        assert served == {"0": routed["0"], "1": routed["1"] + len(prompts)}
        assert per_replica(srv, "conveyor:dp_replica_up") == {"0": 1, "1": 1}
        health = httpx.get(f"{srv.base_url}/health").json()["replicas"]
        assert [(r["url"] == url_replica.base_url, r["local"], r["healthy"]) for r in health] \
            == [(False, True, True), (True, False, True)]


def serve_error(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_url_replica_serving_another_model_is_refused_at_start(tiny_llama, url_replica):
    out = serve_error("--model", tiny_llama, "--served-model-name", "other", "--replica-url",
                      url_replica.base_url)
    assert out.returncode == 2
    (line,) = error_lines(out.stderr)
    assert line.startswith(f"conveyor: error: --replica-url {url_replica.base_url} serves ")
    assert "not other as the front does" in line


def test_an_unreachable_url_replica_at_start_is_a_clear_error(tiny_llama):
    url = f"http://127.0.0.1:{free_port()}"
    out = serve_error("--model", tiny_llama, "--replica-url", url)
    assert out.returncode == 2 and len(error_lines(out.stderr)) == 1, out.stderr
    assert error_lines(out.stderr)[0].startswith(
        f"conveyor: error: --replica-url {url} does not answer")


def test_the_front_routes_responses_and_embeddings_by_their_prompt_tokens():
    """The tokens the front routes by are those the replica will compute: a Responses input
    through the chat template (instructions first), an embedding input as a prompt."""
    from conveyor.model.loader import load_tokenizer

    tokenizer = load_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = front.prompt_tokens(tokenizer, "/v1/chat/completions", {"messages": messages})
    assert chat and front.prompt_tokens(tokenizer, "/v1/responses", {
        "instructions": "Be brief.", "input": "Hi"}) == chat
    assert front.prompt_tokens(tokenizer, "/v1/responses", {
        "instructions": "Be brief.", "input": [{"role": "user", "content": "Hi"}]}) == chat
    assert front.prompt_tokens(tokenizer, "/v1/embeddings", {"input": ["a b", "c"]}) == (
        front.prompt_tokens(tokenizer, "/v1/completions", {"prompt": "a b"}))
    assert front.prompt_tokens(tokenizer, "/v1/responses", {"input": 3}) == []
    assert set(front.ROUTED) >= {"/v1/responses", "/v1/embeddings"}
