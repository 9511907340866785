"""/dashboard in a real browser (tests/browser.py) while a burst runs. Set
CONVEYOR_SCREENSHOT_DIR to keep the screenshots (otherwise they go to pytest's temporary folder).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from browser import browser  # noqa: F401 (a fixture)
from playwright.sync_api import Page

from server_process import ServerProcess

# what the page shows, by its data-metric name, and the /metrics sample each must equal
SHOWN = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
         "generation_tokens_total", "prompt_tokens_total", "request_success_total",
         "num_preemptions_total")
COUNTERS = ("generation_tokens_total", "prompt_tokens_total", "request_success_total",
            "num_preemptions_total")

pytestmark = pytest.mark.slow


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("CONVEYOR_SCREENSHOT_DIR", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def start_burst(base_url: str, max_tokens: list[int], failures: list[str], stagger: float,
                headers: dict | None = None) -> list[threading.Thread]:
    """One thread per request, ``stagger`` seconds apart, so they queue and board the batch
    step by step."""
    def send(i: int, n: int) -> None:
        r = httpx.post(f"{base_url}/v1/completions", timeout=600, headers=headers, json={
            "prompt": f"Request {i}: tell a story about trains", "max_tokens": n,
            "temperature": 0.0, "ignore_eos": True})
        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != n:
            failures.append(f"request {i}: {r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=send, args=(i, n)) for i, n in enumerate(max_tokens)]
    for t in threads:
        t.start()
        time.sleep(stagger)
    return threads


def shown(page: Page) -> dict[str, float]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '.stat b[data-metric], .stat span[data-metric]')].map(el => [el.dataset.metric,
        Number(el.dataset.value)]))""")


def wait_for_updates(page: Page, more: int) -> None:
    """Until the page has applied ``more`` further polls (each polls once, then renders)."""
    now = page.evaluate("window.conveyorDashboard.updates")
    page.wait_for_function(f"window.conveyorDashboard.updates >= {now + more}", timeout=15_000)


def metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics by the page's names: no prefix, request_success added up over finish reasons."""
    out: dict[str, float] = {}
    for key, value in server.metrics().items():
        name = key.removeprefix("conveyor:").split(":")[0]
        out[name] = out.get(name, 0.0) + value
    return out


def open_dashboard(browser, server: ServerProcess, fragment: str = "") -> Page:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.base_url}/dashboard{fragment}")
    page.wait_for_function("window.conveyorDashboard && window.conveyorDashboard.updates >= 1")
    page.errors = errors  # checked at the end of each test
    return page


def run_burst_and_check(browser, server: ServerProcess, max_tokens: list[int],
                        stagger: float = 0.0) -> Page:
    page = open_dashboard(browser, server)
    failures: list[str] = []
    threads = start_burst(server.base_url, max_tokens, failures, stagger)
    page.wait_for_function("window.conveyorDashboard.drawn > 0", timeout=60_000)

    # Under load, the numbers move: what the page shows after one more poll lies between what
    # /metrics said just before that poll and what it says just after.
    before = metrics(server)
    wait_for_updates(page, 2)
    on_page = shown(page)
    after = metrics(server)
    for name in COUNTERS:
        low, high = before.get(name, 0.0), after.get(name, 0.0)  # absent until first counted
        assert low <= on_page[name] <= high, (name, before, on_page, after)
    assert 0 <= on_page["num_requests_running"] <= server_max_seqs(page)

    for t in threads:
        t.join()
    assert failures == []
    wait_for_updates(page, 2)
    on_page, now = shown(page), metrics(server)
    for name in SHOWN:  # at rest: equal, gauges included
        assert on_page[name] == pytest.approx(now[name]), (name, on_page, now)
    assert on_page["request_success_total"] >= len(max_tokens)
    assert float(page.get_attribute("#ttft", "data-value")) > 0  # p95 over the finished ones
    assert page.evaluate("window.conveyorDashboard.segs.some(s => s.phase === 'prefill')")
    assert page.evaluate("window.conveyorDashboard.segs.some(s => s.phase === 'decode')")
    for chart in ("#timeline", "#batch-chart", "#kv-chart", "#tokens-chart"):
        assert page.locator(f"{chart} canvas").count() == 1
    assert page.errors == []
    return page


def server_max_seqs(page: Page) -> int:
    return page.evaluate("window.conveyorDashboard.settings.max_num_seqs")


def test_dashboard_under_an_api_key_opens_with_the_key_in_its_address(browser):
    """The README's /dashboard#key=KEY: the browser loads the page and its scripts without the
    key (it cannot send one with a page load), and the page sends it with each feed request."""
    key = "dashboard-test-key"
    server = ServerProcess("--max-num-seqs", "4", env={"CONVEYOR_API_KEY": key})
    try:
        server.wait_ready()
        failures: list[str] = []
        threads = start_burst(server.base_url, [8, 8, 8], failures, 0.0,
                              {"Authorization": f"Bearer {key}"})
        page = open_dashboard(browser, server, f"#key={key}")
        for t in threads:
            t.join()
        assert failures == []
        wait_for_updates(page, 2)
        assert shown(page)["request_success_total"] >= 3
        assert page.errors == []
        page.close()
    finally:
        server.terminate()


def test_dashboard_follows_a_continuous_burst(browser, screenshot_dir):
    server = ServerProcess("--max-num-seqs", "8")
    try:
        server.wait_ready()
        page = run_burst_and_check(browser, server, [8 + 7 * (i % 8) for i in range(16)])
        # continuous batching refills a freed seat at the next step
        assert float(page.get_attribute("#idle-waiting", "data-value")) < 0.1
        page.select_option("#window", "fit")
        page.screenshot(path=str(screenshot_dir / "dashboard-continuous.png"), full_page=True)
        page.select_option("#lanes", "requests")
        page.wait_for_function("window.conveyorDashboard.drawn > 0")
        page.screenshot(path=str(screenshot_dir / "dashboard-continuous-requests.png"),
                        full_page=True)
        page.close()
    finally:
        server.terminate()


def test_dashboard_shows_the_idle_seats_of_a_static_batch(browser, screenshot_dir):
    server = ServerProcess("--max-num-seqs", "4", "--policy", "static")
    try:
        server.wait_ready()
        # The first request runs alone (nothing else has arrived) while the rest queue in order,
        # so the next batches are exactly [4, 4, 4, 48] x 3: each waits for its one long
        # request while three seats sit empty and requests wait.
        page = run_burst_and_check(browser, server, [40] + [4, 4, 4, 48] * 3, stagger=0.05)
        idle = float(page.get_attribute("#idle-waiting", "data-value"))
        assert idle > 0.4, f"static batch: only {idle:.0%} of seats idle while requests waited"
        assert page.evaluate("window.conveyorDashboard.settings.policy") == "static"
        page.select_option("#window", "fit")
        page.screenshot(path=str(screenshot_dir / "dashboard-static.png"), full_page=True)
        page.close()
    finally:
        server.terminate()


def test_dashboard_marks_preemptions(browser, screenshot_dir):
    # 24 pages of 16 tokens for 8 seats of ~70-token requests: the batch outgrows the pool and
    # the scheduler preempts (by recompute); the page must count and draw them.
    server = ServerProcess("--max-num-seqs", "8", "--num-kv-blocks", "24", "--max-model-len", "256")
    try:
        server.wait_ready()
        page = run_burst_and_check(browser, server, [60] * 16)
        shown_preemptions = float(page.get_attribute('[data-metric="num_preemptions_total"]',
                                                     "data-value"))
        assert shown_preemptions > 0
        drawn = page.evaluate("[...conveyorDashboard.reqs.values()]"
                              ".reduce((n, r) => n + r.preempts.length, 0)")
        assert drawn == shown_preemptions  # one red mark per preemption /metrics counted
        page.select_option("#window", "fit")
        page.screenshot(path=str(screenshot_dir / "dashboard-preemption.png"), full_page=True)
        page.close()
    finally:
        server.terminate()
