"""`conveyor bench simulate`: the simulator decides as the live engine does, its step-cost models,
and the commands end to end."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.cost_model import FittedCost, StepShape, live_samples
from conveyor.bench.roofline import GIB, MODEL_CONFIGS, RooflineCost, accelerator, layer_weights
from conveyor.bench.simulated_engine import EngineSettings, SimulatedRequest, Simulator
from conveyor.cli import main
from conveyor.config import EngineConfig
from conveyor.core.scheduler import SchedulerConfig
from conveyor.engine.engine import LLMEngine
from conveyor.sampling_params import SamplingParams


class ConstantCost:
    """Every step takes one second: step k ends at k + 1, so an arrival at k is step k's."""

    def step_seconds(self, shape: StepShape) -> float:
        return 1.0


# (arrival step, prompt tokens, output tokens); the third shares the first's two leading pages
ARRIVALS = [(0, 40, 30), (0, 70, 12), (2, 40, 25), (5, 20, 40), (9, 90, 8), (14, 10, 5)]
POOL = dict(num_kv_blocks=12, block_size=16, max_num_seqs=3, max_num_batched_tokens=48,
            max_model_len=128)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    out = [[rng.randrange(vocab) for _ in range(n)] for _, n, _ in ARRIVALS]
    out[2][:32] = out[0][:32]
    return out


def decision(plan, finished) -> tuple:
    return (tuple((r.request_id, n) for r, n in plan.scheduled),
            tuple(r.request_id for r in plan.preempted), tuple(sorted(finished)))


def live_decisions(folder: str, policy: str) -> list[tuple]:
    engine = LLMEngine(EngineConfig(model=folder, policy=policy, **POOL))
    ids = prompts(engine.model_config.vocab_size)
    plans = []
    schedule = engine.scheduler.schedule

    def recording(now):
        plans.append(schedule(now))
        return plans[-1]

    engine.scheduler.schedule = recording
    log, pending, step = [], list(range(len(ARRIVALS))), 0
    while pending or engine.has_unfinished_requests():
        while pending and ARRIVALS[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), ids[i], SamplingParams(max_tokens=ARRIVALS[i][2],
                                                              ignore_eos=True))
        finished = [o.request_id for o in engine.step() if o.finished]
        log.append(decision(plans[-1], finished))
        step += 1
    return log


def simulated_decisions(vocab: int, policy: str) -> list[tuple]:
    settings_ = EngineSettings(
        SchedulerConfig(POOL["max_num_seqs"], POOL["max_num_batched_tokens"],
                        POOL["max_model_len"], policy),
        POOL["num_kv_blocks"], POOL["block_size"])
    requests = [SimulatedRequest(float(t), ids, n_out)
                for (t, _, n_out), ids in zip(ARRIVALS, prompts(vocab))]
    log = []
    sim = Simulator(settings_, ConstantCost()).run(
        requests, on_step=lambda plan, done: log.append(
            decision(plan, [r.request_id for r in done])))
    assert all(r.success and r.output_tokens == n for r, (_, _, n) in zip(sim.results, ARRIVALS))
    return log


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_simulator_makes_the_live_engines_decisions(tiny_checkpoint, policy):
    """Same arrivals and completions: the same requests scheduled (with the same token counts),
    preempted and finished at every step."""
    folder = tiny_checkpoint("llama")
    live = live_decisions(folder, policy)
    simulated = simulated_decisions(49152, policy)
    assert all(scheduled for scheduled, _, _ in live)  # never idle, so step k is step k in both
    assert simulated == live
    assert any(preempted for _, preempted, _ in live)  # the pool is small enough to preempt
    if policy == "continuous":  # the third request found the first's two pages cached
        assert ("2", 40 - 32) in [s for scheduled, _, _ in live for s in scheduled]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20), st.integers(1, 60), st.integers(1, 40)),
                min_size=1, max_size=25),
       st.sampled_from(["continuous", "static"]), st.integers(13, 40),
       st.sampled_from([None, 1, 3]), st.booleans())
def test_every_simulated_request_completes_and_frees_its_pages(rows, policy, num_blocks,
                                                               concurrency, caching):
    rng = random.Random(len(rows))
    requests = [SimulatedRequest(t, [rng.randrange(50) for _ in range(n_in)], n_out)
                for t, n_in, n_out in rows]
    settings_ = EngineSettings(SchedulerConfig(4, 32, 100, policy), num_blocks, 8,
                               enable_prefix_caching=caching)
    simulator = Simulator(settings_, ConstantCost(), concurrency)
    sim = simulator.run(requests)
    for r, req in zip(sim.results, requests):
        if len(req.prompt_token_ids) + req.output_len > 100:
            assert not r.success and "max_model_len" in r.error
            continue
        assert r.success and r.output_tokens == req.output_len
        assert r.start_time >= req.arrival and 0 < r.ttft <= r.latency
        assert len(r.itl) == req.output_len - 1
    assert simulator.scheduler.kv.pool.num_used_blocks == 0
    assert all(s.num_scheduled <= 4 and s.num_prefill_tokens + s.num_decode_tokens <= 32
               for s in sim.steps)
    if concurrency is not None:  # never more requests in flight than the clients allow
        ok = [r for r in sim.results if r.success]
        for r in ok:
            # (a request a client sends as another ends starts at that end, which start +
            # latency can overshoot by a rounding)
            live = sum(1 for o in ok
                       if o.start_time <= r.start_time < o.start_time + o.latency - 1e-9)
            assert live <= concurrency


def test_fit_recovers_a_linear_cost_and_keeps_coefficients_nonnegative(tmp_path):
    truth = {"fixed": 0.01, "per_decode": 0.002, "per_prefill_token": 0.0005,
             "per_context_token": 3e-6, "per_attention_pair": 1e-9}
    rng = random.Random(1)
    shapes = []
    for _ in range(60):
        d, p, ctx = rng.randint(0, 32), rng.choice([0, 0, 16, 300]), rng.randint(0, 9000)
        shapes.append(StepShape(d + (p > 0), d, p, ctx + p, ctx + p * p // 2))
    exact = FittedCost(truth, {})
    fitted = FittedCost.fit([(s, exact.step_seconds(s)) for s in shapes], {"from": "test"}, 10)
    for term, value in truth.items():
        assert fitted.coefficients[term] == pytest.approx(value, rel=1e-6)
    assert fitted.median_relative_error < 1e-9

    # a cost that falls with decodes cannot be fitted as such: that coefficient stays at zero
    falling = FittedCost({**truth, "per_decode": -1e-4}, {})
    clipped = FittedCost.fit([(s, falling.step_seconds(s)) for s in shapes], {}, 10)
    assert min(clipped.coefficients.values()) >= 0 and clipped.coefficients["per_decode"] == 0

    path = tmp_path / "cost.json"
    fitted.save(str(path))
    assert FittedCost.load(str(path)) == fitted
    path.write_text('{"version": 1}')
    with pytest.raises(ValueError, match="conveyor bench profile"):
        FittedCost.load(str(path))


def test_live_samples_time_steps_from_the_previous_steps_end():
    def record(step, end, duration, scheduled=2, running=2):
        return dict(step=step, time=end, duration=duration, num_scheduled=scheduled,
                    num_running=running, num_waiting=0, num_decode_tokens=scheduled,
                    num_prefill_tokens=0, num_context_tokens=10, num_attention_pairs=10)

    records = [record(0, 1.0, 0.1), record(1, 1.12, 0.1), record(2, 1.3, 0.15, running=0),
               record(3, 9.0, 0.1), record(5, 9.5, 0.1)]
    samples = live_samples(records)
    # step 1 after step 0's end; step 3 followed an idle engine and step 5 a gap in the record
    assert [round(t, 3) for _, t in samples] == [0.12, 0.18]


def test_roofline_decode_reads_the_weights_and_prefill_is_compute_bound():
    config = MODEL_CONFIGS["llama-3-8b"]
    cost = RooflineCost(accelerator("H100"), config)
    weights = cost.weight_bytes
    assert 15.5e9 < weights < 16.5e9  # 8.0B parameters in bf16
    lone = cost.step_seconds(StepShape(1, 1, 0, 100, 100))
    read = 2 * (32 * layer_weights(config) + 128256 * 4096) + cost.kv_bytes_per_token * 101
    assert lone == pytest.approx(read / (3.35e12 * 0.8) + 1e-3 + 10e-6)  # the embedding unread
    full = cost.step_seconds(StepShape(32, 32, 0, 32 * 500, 32 * 500))
    assert full < 1.3 * lone  # a GPU decode step costs nearly the same at 32 as at 1
    prefill = cost.step_seconds(StepShape(1, 0, 2048, 2048, 2048 * 2049 // 2))
    assert prefill > 2 * 7e9 * 2048 / (989e12 * 0.6)
    kv = cost.kv_cache_bytes()
    assert kv == int(81559 * 2**20 * 0.9) - weights - GIB
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    with pytest.raises(ValueError, match="weight-bits"):
        RooflineCost(accelerator("H100"), MODEL_CONFIGS["llama-3-70b"]).kv_cache_bytes()
    with pytest.raises(ValueError, match="H200"):
        accelerator("TPU-v9")


def test_simulate_command_writes_the_report_json_and_plots(tmp_path, capsys):
    main(["bench", "simulate", "--accelerator", "H100", "--model-config", "llama-3-8b",
          "--dataset-name", "random", "--num-prompts", "30", "--random-input-len", "200",
          "--random-output-len", "100", "--random-range-ratio", "0.5", "--request-rate", "20",
          "--policy", "static", "continuous", "--max-num-seqs", "8", "--ignore-eos",
          "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"])
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "static/8" in out and "continuous/8" in out
    assert "simulated continuous/static" in out
    summary = json.loads((tmp_path / "simulate.json").read_text())
    runs = {r["label"]: r["result"] for r in summary["runs"]}
    for result in runs.values():
        assert result["completed"] == 30 and result["p95_ttft_ms"] > 0
        assert result["total_input_tokens"] == runs["static/8"]["total_input_tokens"]
    assert summary["predicted_ratio"]["8"] > 1  # on a GPU continuous wins
    saved = json.loads((tmp_path / "simulate-continuous-8.json").read_text())
    assert saved["output_throughput"] == runs["continuous/8"]["output_throughput"]
    # as vLLM saves without --save-detailed: no list with an entry per request or step
    for record in (saved, *runs.values(), *summary["runs"]):
        assert not [k for k, v in record.items() if isinstance(v, list)], record.keys()
    for name in ("throughput.png", "latency_cdf.png", "occupancy.png"):
        assert (tmp_path / name).stat().st_size > 5000


def test_simulate_replays_a_trace_with_shared_prefixes(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1200, "output_length": 20,
             "hash_ids": [7, 8, 100 + i]} for i in range(12)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        main(["bench", "simulate", "--trace", str(trace), "--accelerator", "L4",
              "--model-config", "llama-3-8b", caching, "--result-dir", str(tmp_path / caching),
              "--save-detailed"])
    runs = [json.loads((tmp_path / c / "simulate.json").read_text())["runs"][0]
            for c in ("--enable-prefix-caching", "--no-enable-prefix-caching")]
    results = [run["result"] for run in runs]
    assert [r["completed"] for r in results] == [12, 12]
    assert results[0]["input_lens"] == [1200] * 12 and len(results[0]["itls"]) == 12
    assert sum(s["num_prefill_tokens"] for s in runs[1]["steps"]) == 12 * 1200
    # 1024 of each prompt's 1200 tokens are the first one's pages
    assert results[0]["mean_ttft_ms"] < results[1]["mean_ttft_ms"]


def test_simulate_refuses_without_a_cost_model_or_with_a_bad_trace(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "simulate", "--num-prompts", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["conveyor: error: give --cost-model FILE (from `conveyor bench profile`) or "
                   "--accelerator NAME, one of them"]
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n\n'
                     '{"timestamp": 5, "input_length": 10}\n')
    with pytest.raises(SystemExit):
        main(["bench", "simulate", "--trace", str(trace), "--accelerator", "L4",
              "--model-config", "llama-3-8b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"conveyor: error: {trace}:3: expected")


def test_profile_then_simulate_and_tune_on_the_fit(tiny_checkpoint, tmp_path, capsys):
    folder = tiny_checkpoint("llama")
    cost_path = tmp_path / "cost.json"
    main(["bench", "profile", "--model", folder, "--batch-sizes", "1", "4", "--context-lens", "16",
          "64", "--prefill-chunks", "8", "32", "--decode-steps", "3", "--output", str(cost_path)])
    assert "profile (context, batch) points: 100%" in capsys.readouterr().err  # its progress
    cost = FittedCost.load(str(cost_path))
    assert cost.num_samples >= 10 and cost.coefficients["fixed"] > 0
    assert cost.source["from"] == "grid" and cost.source["model"] == folder
    main(["bench", "tune", "--simulate", "--cost-model", str(cost_path), "--model", folder,
          "--slo", "e2el_p95=60s", "--max-num-seqs", "2", "8", "--dataset-name", "random",
          "--num-prompts", "20", "--random-input-len", "32", "--random-output-len", "16",
          "--ignore-eos", "--result-dir", str(tmp_path), "--disable-tqdm"])
    out = capsys.readouterr().out
    assert "recommended: seqs=" in out
    tune = json.loads((tmp_path / "tune.json").read_text())
    assert [p["max_num_seqs"] for p in tune["points"]] == [2, 8]
    assert tune["simulated"].startswith(f"{cost.coefficients['fixed'] * 1e3:.2f} ms")
