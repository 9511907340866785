"""``GET /dashboard``: a live page of the running batch, and the feed it polls.

The feed is incremental (``since_step``, ``since_event``) and compact (rows of numbers, named once
in ``fields``), so a page open during a load of hundreds of requests costs the engine thread
nothing: everything here runs on the HTTP side and only copies the engine's bounded records.
"""

from __future__ import annotations

import time
from importlib.resources import files

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from conveyor.server.state import ServerState

STATIC_DIR = files("conveyor.server") / "static"

STEP_FIELDS = ("step", "time", "duration", "num_scheduled", "num_running", "num_waiting",
               "num_prefill_tokens", "num_decode_tokens", "kv_pages_used", "kv_pages_cached",
               "num_preemptions")
SEATING_FIELDS = ("step", "start", "end", "entries: seq, slot, tokens, phase (0 prefill, 1 decode)")
EVENT_FIELDS = ("index", "kind", "seq", "time", "value", "request_id", "arrival", "first_token")


def feed(state: ServerState, since_step: int, since_event: int, window: float) -> dict:
    engine = state.engine
    timeline = engine.timeline
    now = time.monotonic()
    not_before = now - window
    # copy the engine's counters first: "next" must not run ahead of what was copied
    next_step, next_event = engine.num_steps, timeline.num_events
    steps = [r for r in engine.steps_since(since_step) if r.time >= not_before]
    seating = timeline.steps_since(since_step, not_before)
    events = timeline.events_since(since_event, not_before)
    cfg = engine.config
    kv = engine.scheduler.kv
    return {
        "now": now,
        "settings": {
            "model": state.model_name, "dtype": str(engine.dtype).removeprefix("torch."),
            "policy": cfg.policy, "scheduling_policy": cfg.scheduling_policy,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "num_kv_pages": kv.pool.num_blocks, "block_size": kv.block_size,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "max_model_len": engine.max_model_len,
        },
        "metrics": state.metrics.snapshot(),
        "fields": {"steps": STEP_FIELDS, "seating": SEATING_FIELDS, "events": EVENT_FIELDS},
        "steps": [[getattr(r, f) for f in STEP_FIELDS] for r in steps if r.step < next_step],
        "seating": [[s.step, s.start, s.end, s.entries.tolist()] for s in seating
                    if s.step < next_step],
        "events": [[e.index, e.kind, e.seq, e.time, e.value, e.request_id, e.arrival,
                    e.first_token] for e in events if e.index < next_event],
        "next_step": next_step,
        "next_event": next_event,
    }


def dashboard_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", response_class=HTMLResponse,
                summary="a live view of the batch (open it in a browser)")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "dashboard.html").read_text())

    @router.get("/v1/engine/dashboard", summary="what the dashboard polls: steps, seats, events")
    async def dashboard_feed(since_step: int = Query(0, ge=0), since_event: int = Query(0, ge=0),
                             window: float = Query(60.0, gt=0, le=3600)) -> dict:
        return feed(state, since_step, since_event, window)

    return router


def mount_static(app) -> None:
    app.mount("/dashboard/static", StaticFiles(directory=str(STATIC_DIR)), name="dashboard")
