"""The engine's step loop and output processing with a fake runner: no forward pass, each row's
token written by a script, so that what the engine does with tokens is checked on its own
(n samples, stop strings and tokens, logprobs, a failed row, preemption, aborts, pages)."""

from __future__ import annotations

import pytest

from conveyor.config import EngineConfig
from conveyor.core.scheduler import samples
from conveyor.engine import engine as engine_module
from conveyor.engine.engine import LLMEngine
from conveyor.sampling_params import SamplingParams
from conveyor.worker.runner import StepResult
from conveyor.worker.sampler import SampleResult

from tiny_models import smollm2_tokenizer

TEXT = " one two three four five six seven eight nine ten eleven twelve"


class ScriptedRunner:
    """A ModelRunner's interface; request i's k-th sampled token is its script's k-th."""

    scripts: dict[str, list[int]] = {}
    failing: set[str] = set()

    def __init__(self, config, weights, **setup) -> None:
        self.kernel_path = "scripted"
        self.steps = []

    def execute(self, out) -> StepResult:
        self.steps.append([(r.request_id, n) for r, n in out.scheduled])
        found = {}
        for r, n in out.scheduled:
            if not samples(r, n):
                continue
            script = self.scripts[r.request_id.split("_")[-1]]
            token = script[r.num_output_tokens % len(script)]
            # the sampled token at rank 1, then the next ids down from rank 2
            logprobs = ([(token, -0.5, 1)] + [(token + 1 + k, -1.0 - k, k + 2) for k in range(
                r.sampling_params.logprobs)] if r.sampling_params.logprobs else None)
            error = "row failed" if r.request_id in self.failing else None
            found[r.request_id] = SampleResult(token, logprobs, error)
        return StepResult(found, {})


@pytest.fixture
def engine(monkeypatch, tiny_checkpoint):
    monkeypatch.setattr(engine_module, "ModelRunner", ScriptedRunner)
    ScriptedRunner.scripts, ScriptedRunner.failing = {}, set()
    made = []

    def build(**settings) -> LLMEngine:
        config = EngineConfig(model=tiny_checkpoint("llama"), dtype="float32", block_size=4,
                              **{"num_kv_blocks": 64, **settings})
        made.append(LLMEngine(config))
        return made[-1]

    yield build
    for e in made:  # no leaks: every page back in the pool
        pool = e.scheduler.kv.pool
        assert not e.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks


def run(engine: LLMEngine) -> dict:
    final = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("the engine did not finish")


def script(text: str) -> list[int]:
    return smollm2_tokenizer().encode(text, add_special_tokens=False)


def test_text_tokens_n_samples_and_length(engine):
    e = engine()
    ScriptedRunner.scripts = {"a": script(TEXT)}
    e.add_request("a", "Count:", SamplingParams(max_tokens=5, n=2, ignore_eos=True))
    (out,) = run(e).values()
    want = script(TEXT)[:5]
    assert [c.token_ids for c in out.outputs] == [want, want]
    assert [c.text for c in out.outputs] == [smollm2_tokenizer().decode(want)] * 2
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert out.metrics.finished_time >= out.metrics.first_token_time >= out.metrics.arrival_time


def test_a_stop_string_cuts_the_text_and_ends_the_request(engine):
    e = engine()
    ScriptedRunner.scripts = {"a": script(TEXT), "b": script(TEXT)}
    e.add_request("a", "Count:", SamplingParams(max_tokens=30, stop=[" four"], ignore_eos=True))
    e.add_request("b", "Count:", SamplingParams(max_tokens=6, ignore_eos=True))
    done = run(e)
    a = done["a"].outputs[0]
    assert (a.text, a.finish_reason, a.stop_reason) == (" one two three", "stop", " four")
    assert len(done["b"].outputs[0].token_ids) == 6  # its neighbour's stop does not touch it


def test_a_stop_token_ends_it_and_min_tokens_holds_it_off(engine):
    e = engine()
    words = script(TEXT)
    ScriptedRunner.scripts = {"a": words, "b": words}
    e.add_request("a", "x", SamplingParams(max_tokens=20, stop_token_ids=[words[2]]))
    e.add_request("b", "x", SamplingParams(max_tokens=20, stop_token_ids=[words[2]],
                                           min_tokens=5))
    done = run(e)
    assert done["a"].outputs[0].token_ids == words[:3]
    assert done["a"].outputs[0].stop_reason == words[2]
    # held off at its third token (min_tokens 5), it ends where the script meets it again
    assert done["b"].outputs[0].token_ids == (words * 2)[:len(words) + 3]


def test_logprobs_are_decoded_and_ranked(engine):
    e = engine()
    words = script(TEXT)
    ScriptedRunner.scripts = {"a": words}
    e.add_request("a", "x", SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True))
    (out,) = run(e).values()
    steps = out.outputs[0].logprobs
    assert len(steps) == 3
    first = steps[0]
    assert first[words[0]].rank == 1 and first[words[0]].logprob == -0.5
    assert [first[words[0] + k].rank for k in (1, 2)] == [2, 3] and len(first) == 3
    tokenizer = smollm2_tokenizer()
    assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in first.items())


def test_a_failed_row_fails_its_request_alone(engine):
    e = engine()
    ScriptedRunner.scripts = {"a": script(TEXT), "b": script(TEXT)}
    ScriptedRunner.failing = {"1_a"}
    e.add_request("a", "x", SamplingParams(max_tokens=4, n=2, ignore_eos=True))
    e.add_request("b", "x", SamplingParams(max_tokens=4, ignore_eos=True))
    done = run(e)
    assert done["a"].error == "row failed"
    assert {c.finish_reason for c in done["a"].outputs} == {"error"}
    assert done["b"].error is None and len(done["b"].outputs[0].token_ids) == 4


def test_preempted_requests_still_get_their_tokens(engine):
    """A pool of 12 pages of 4 for 6 requests of 10 + 16 tokens: they are preempted and
    recomputed, and each still gets its script."""
    e = engine(num_kv_blocks=12, max_model_len=32)
    ScriptedRunner.scripts = {str(i): script(TEXT)[i:] for i in range(6)}
    for i in range(6):
        e.add_request(str(i), "a b c d e f g h i j", SamplingParams(max_tokens=16,
                                                                  ignore_eos=True))
    done = run(e)
    assert sum(o.metrics.num_preemptions for o in done.values()) > 0
    for i in range(6):
        words = script(TEXT)[i:]
        assert done[str(i)].outputs[0].token_ids == [words[k % len(words)] for k in range(16)]


def test_an_abort_frees_its_pages_and_the_rest_go_on(engine):
    e = engine()
    ScriptedRunner.scripts = {"a": script(TEXT), "b": script(TEXT)}
    e.add_request("a", "x", SamplingParams(max_tokens=8, ignore_eos=True))
    e.add_request("b", "x", SamplingParams(max_tokens=8, ignore_eos=True))
    e.step()
    e.step()
    e.abort_request("a")
    done = run(e)
    assert list(done) == ["b"] and len(done["b"].outputs[0].token_ids) == 8
    assert all("a" not in {rid for rid, _ in step} for step in e.runner.steps[2:])
