"""`conveyor bench compare` and `bench tune` end to end on the default model, small workloads."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import matplotlib.image
import pytest

from conveyor.bench.compare import add_compare_args, run_config, server_flags
from conveyor.bench.serve import build_workload
from conveyor.bench.tune import parse_slo, recommend
from conveyor.model.loader import load_tokenizer


def bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "conveyor.cli", "bench", *args],
                          capture_output=True, text=True, timeout=900, env=env)


WORKLOAD = ["--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "48",
            "--random-output-len", "24", "--random-range-ratio", "0.9", "--ignore-eos",
            "--kv-cache-memory", "128MiB", "--disable-tqdm"]


@pytest.mark.slow
def test_compare_prints_the_table_and_writes_json_and_plots(tmp_path):
    res = bench("compare", *WORKLOAD, "--max-num-seqs", "4", "--result-dir", str(tmp_path),
                "--save-detailed")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "config" in out and "static/4" in out and "continuous/4" in out
    assert "ideal static/continuous step ratio" in out and "measured continuous/static" in out

    summary = json.loads((tmp_path / "compare.json").read_text())
    runs = {r["label"]: r for r in summary["runs"]}
    assert set(runs) == {"static/4", "continuous/4"}
    for run in runs.values():
        assert run["result"]["completed"] == 12 and run["result"]["failed"] == 0
        assert run["result"]["output_throughput"] > 0
        assert run["steps"] and max(s["num_scheduled"] for s in run["steps"]) <= 4
        # every requested token was generated (ignore_eos), counted by the server's usage
        assert run["result"]["total_output_tokens"] == sum(run["result"]["output_lens"])
    # the same seeded workload went to both
    assert runs["static/4"]["result"]["input_lens"] == runs["continuous/4"]["result"]["input_lens"]
    assert summary["ideal_ratio"]["4"] >= 1

    for name in ("throughput.png", "latency_cdf.png", "occupancy.png"):
        path = tmp_path / name
        assert path.stat().st_size > 5000
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert image.std() > 0.01  # not a blank canvas


def test_each_measured_run_starts_from_a_cold_prefix_cache(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("llama")
    p = argparse.ArgumentParser()
    add_compare_args(p)
    args = p.parse_args([*WORKLOAD, "--model", folder, "--result-dir", str(tmp_path)])
    workload = build_workload(args, load_tokenizer(folder))
    run = run_config(args, workload, "continuous/4", server_flags(args, "continuous", 4),
                     repeats=2)
    runs = [run, *run["reruns"]]
    assert [r["result"]["completed"] for r in runs] == [12, 12]
    # the same prompts a second time are computed again: the first run left nothing cached
    prefill = [sum(s["num_prefill_tokens"] for s in r["steps"]) for r in runs]
    assert prefill[0] == prefill[1] >= sum(run["result"]["input_lens"])


def test_slo_parsing_and_recommendation():
    assert parse_slo("ttft_p95=2s") == ("ttft", "95", 2000.0)
    assert parse_slo("tpot_p99=80ms") == ("tpot", "99", 80.0)
    for bad in ("ttft=2s", "p95=2s", "ttft_p95=2", "ttft_p100=1s"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    points = [{"label": "seqs=4", "throughput": 50.0, "latency_ms": 900.0},
              {"label": "seqs=16", "throughput": 120.0, "latency_ms": 1800.0},
              {"label": "seqs=64", "throughput": 150.0, "latency_ms": 4000.0}]
    best, message = recommend(points, 2000.0, "ttft_p95")
    assert best["label"] == "seqs=16" and message.startswith("recommended: seqs=16")
    best, message = recommend(points, 500.0, "ttft_p95")
    assert best["label"] == "seqs=4" and "no setting meets" in message and "400 ms (80%) over" in message
