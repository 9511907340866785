"""What an open /dashboard costs the engine: the same load with no viewer, with a client polling
the dashboard feed as the page does (the server-side cost alone), and with the page open in
headless chromium on this same machine (server cost plus the browser's own CPU), interleaved
round by round on one server, medians compared.

Also reports how long the page takes per refresh with hundreds of requests in flight, and can save
a screenshot taken mid-load.

    .venv/bin/python benchmarks/dashboard_overhead.py --screenshot docs/dashboard/continuous.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import httpx

from conveyor.bench.serve import add_serve_args, benchmark, build_workload, served_model
from conveyor.process import ConveyorServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHROMIUM = "/usr/bin/chromium"
LAUNCH_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]
POLL_S = 0.5  # the page's refresh period


class FeedPoller:
    """Polls /v1/engine/dashboard incrementally, twice a second, like the page."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.stop, self.polls, self.open_s = base_url, threading.Event(), 0, 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        cursor = {"since_step": 0, "since_event": 0, "window": 300}
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            while not self.stop.wait(POLL_S):
                feed = client.get("/v1/engine/dashboard", params=cursor).json()
                cursor = {"since_step": feed["next_step"], "since_event": feed["next_event"]}
                self.polls += 1

    def __enter__(self) -> "FeedPoller":
        self._opened = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.open_s = time.monotonic() - self._opened


class OpenPage:
    """The dashboard open in headless chromium for the duration of a run."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.render_ms: list[float] = []
        self.updates, self.open_s = 0, 0.0

    def __enter__(self) -> "OpenPage":
        from playwright.sync_api import sync_playwright
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_FLAGS)
        self.page = self._browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.goto(f"{self.base_url}/dashboard")
        self.page.wait_for_function("window.conveyorDashboard && conveyorDashboard.updates >= 1")
        self.page.evaluate("conveyorDashboard.renderMs.length = 0")
        self._start_updates = self.page.evaluate("conveyorDashboard.updates")
        self._opened = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.render_ms = self.page.evaluate("conveyorDashboard.renderMs")
        self.updates = self.page.evaluate("conveyorDashboard.updates") - self._start_updates
        self.open_s = time.monotonic() - self._opened
        self._browser.close()
        self._pw.stop()


def in_flight(base_url: str) -> int:
    feed = httpx.get(f"{base_url}/v1/engine/dashboard", params={"window": 1}).json()
    return int(feed["metrics"]["num_requests_running"] + feed["metrics"]["num_requests_waiting"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_serve_args(p)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-flags", default="--max-num-seqs 64")
    p.add_argument("--screenshot", default=None, help="PNG of the page mid-load (first round)")
    args = p.parse_args()
    if args.num_prompts == 100:  # hundreds in flight by default
        args.num_prompts = 256
        args.random_input_len, args.random_output_len, args.random_range_ratio = 64, 48, 0.5
    args.ignore_eos = args.disable_tqdm = True
    workload = build_workload(args)
    runs: dict[str, list[dict]] = {"none": [], "poll": [], "browser": []}
    log = os.path.join(tempfile.gettempdir(), "conveyor-dashboard-overhead.log")
    with ConveyorServer(args.server_flags.split(), log) as server:
        args.base_url = server.base_url
        args.model = served_model(server.base_url)
        server.warm_up(args.model)
        for rnd in range(args.rounds):
            for config in runs:
                httpx.post(f"{server.base_url}/reset_prefix_cache").raise_for_status()
                row: dict = {}
                if config == "none":
                    result = benchmark(args, workload)
                elif config == "poll":
                    with FeedPoller(server.base_url) as poller:
                        result = benchmark(args, workload)
                    row["refresh_rate"] = poller.polls / poller.open_s
                else:
                    with OpenPage(server.base_url) as page:
                        result = run_with_page(args, workload, page,
                                               args.screenshot if rnd == 0 else None)
                    row.update(refresh_rate=page.updates / page.open_s, render_ms=page.render_ms)
                row.update(tok_s=result["output_throughput"], tpot=result["mean_tpot_ms"],
                           failed=result["failed"], duration=result["duration"])
                runs[config].append(row)
                print(f"round {rnd} {config:>8}: {row['tok_s']:.1f} output tok/s, "
                      f"mean TPOT {row['tpot']:.1f} ms, failed {row['failed']}", flush=True)

    base = statistics.median(r["tok_s"] for r in runs["none"])
    print(f"\n{'viewer':<10}{'output tok/s (median)':>23}{'vs none':>9}{'mean TPOT ms':>14}"
          f"{'refreshes/s':>13}")
    for config, rows in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in rows)
        rate = (statistics.median(r["refresh_rate"] for r in rows)
                if config != "none" else float("nan"))
        print(f"{config:<10}{tok_s:>23.1f}{tok_s / base:>9.3f}"
              f"{statistics.median(r['tpot'] for r in rows):>14.1f}{rate:>13.2f}")
    render = [ms for r in runs["browser"] for ms in r["render_ms"]]
    if render:
        render.sort()
        print(f"page refresh (ingest + draw) with up to {args.num_prompts} requests in flight: "
              f"median {statistics.median(render):.1f} ms, p95 {render[int(0.95 * len(render))]:.1f}"
              f" ms, max {render[-1]:.1f} ms over {len(render)} refreshes")


def run_with_page(args, workload, page: "OpenPage", screenshot: str | None) -> dict:
    """The load on a second thread: Playwright's sync API stays on this one, which takes the
    screenshot once most of the burst is in flight and the page has drawn a few seconds of it."""
    out: dict = {}
    bench = threading.Thread(target=lambda: out.update(benchmark(args, workload)))
    bench.start()
    if screenshot:
        while bench.is_alive() and in_flight(args.base_url) < args.num_prompts // 2:
            time.sleep(0.2)
        time.sleep(8)
        page.page.screenshot(path=screenshot, full_page=True)
    bench.join()
    return out


if __name__ == "__main__":
    main()
