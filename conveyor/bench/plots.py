"""PNG plots for ``bench compare`` and ``bench tune`` (matplotlib, no display needed)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(runs: list[dict], out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(runs)), 4))
    labels = [r["label"] for r in runs]
    values = [r["result"]["output_throughput"] for r in runs]
    bars = ax.bar(labels, values, color=["#d62728" if "static" in lbl else "#1f77b4"
                                         for lbl in labels])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput")
    return _save(fig, os.path.join(out_dir, "throughput.png"))


def plot_latency_cdfs(runs: list[dict], out_dir: str) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttfts", "Time to first token"),
                           (axes[1], "e2els", "End-to-end latency")):
        for r in runs:
            ok = [v for v, e in zip(r["result"][key], r["result"]["errors"]) if not e]
            if not ok:
                continue
            x = np.sort(ok)
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=r["label"])
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title + " (CDF)")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, os.path.join(out_dir, "latency_cdf.png"))


def plot_occupancy(runs: list[dict], out_dir: str) -> str:
    """Batch occupancy and queue depth per step: a static batch's idle seats show as the gap
    between its occupancy and the seat limit while requests wait."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        steps = r["steps"]
        if not steps:
            ax.set_title(f"{r['label']}: no steps recorded")
            continue
        t0 = steps[0]["time"] - steps[0]["duration"]
        t = [s["time"] - t0 for s in steps]
        ax.fill_between(t, [s["num_scheduled"] for s in steps], step="pre", alpha=0.5,
                        label="requests in the batch")
        ax.plot(t, [s["num_waiting"] for s in steps], drawstyle="steps-pre", color="#ff7f0e",
                label="waiting")
        ax.axhline(r["max_num_seqs"], color="k", ls="--", lw=1, label="max_num_seqs")
        top = max([r["max_num_seqs"], *(s["num_waiting"] for s in steps)])
        ax.set_ylim(0, top * 1.1 + 0.5)
        ax.set_title(r["label"])
        ax.set_ylabel("requests")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the first step")
    return _save(fig, os.path.join(out_dir, "occupancy.png"))


def plot_tune(points: list[dict], metric: str, target_ms: float, out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [p["latency_ms"] for p in points]
    y = [p["throughput"] for p in points]
    ax.plot(x, y, "o-")
    for p in points:
        ax.annotate(p["label"], (p["latency_ms"], p["throughput"]), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
    ax.axvline(target_ms, color="r", ls="--", label=f"target {metric} = {target_ms:.0f} ms")
    ax.set_xlabel(f"{metric} (ms)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput against tail latency, per setting")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, os.path.join(out_dir, "tune.png"))
