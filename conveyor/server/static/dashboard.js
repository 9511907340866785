"use strict";
// The live view of the batch. Polls /v1/engine/dashboard twice a second (incrementally), keeps the
// last few minutes in the page, and draws them with uPlot: the batch timeline is a uPlot chart whose
// draw hook paints one lane per seat (or per request); the other panels are plain uPlot series.
(() => {
  const POLL_MS = 500;
  const KEEP_S = 300;           // history kept in the page
  const LATENCY_WINDOW_S = 60;  // TTFT / TPOT / E2E percentiles over requests finished in this
  const RATE_WINDOW_S = 10;     // output tokens/s over this
  const MAX_REQUEST_LANES = 200;

  const css = name => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const COLOR = {
    queued: css("--queued"), prefill: css("--prefill"), decode: css("--decode"),
    decodeAlt: css("--decode-alt"), preempt: css("--preempt"), idle: css("--idle"),
    running: css("--running"), waiting: css("--waiting"), muted: css("--muted"),
    border: css("--border"), text: css("--text"),
  };

  const S = {
    now: 0, nextStep: 0, nextEvent: 0, settings: null, metrics: {}, updates: 0,
    steps: [],          // per-step records (objects named by the feed's fields)
    segs: [],           // bars on the timeline: {seq, slot, t0, t1, phase, tokens, step}
    open: new Map(),    // seq -> its last decode bar, extended while the sample keeps decoding
    reqs: new Map(),    // seq -> {seq, id, arrival, prompt, waits, preempts, end, reason, out, ...}
    finished: [],       // {time, ttft, tpot, e2el} of requests that ended normally
    tokensSeen: [],     // [now, generation_tokens_total] per poll
    drawn: 0,           // bars painted in the last frame (read by the browser test)
    renderMs: [],       // how long each refresh took to ingest and draw (the last 600)
  };

  // -- ingesting the feed --------------------------------------------------------------------
  function ingest(feed) {
    S.now = feed.now;
    S.settings = feed.settings;
    S.metrics = feed.metrics;
    S.nextStep = feed.next_step;
    S.nextEvent = feed.next_event;
    const stepFields = feed.fields.steps;
    for (const row of feed.steps) {
      const rec = {};
      stepFields.forEach((f, i) => { rec[f] = row[i]; });
      S.steps.push(rec);
    }
    // Seating and events in time order: a sample arrives before it is seated, is seated before
    // it finishes, and is preempted before it is seated again.
    const items = feed.seating.map(s => ({time: s[1], seating: s}))
      .concat(feed.events.map(e => ({time: e[3], event: e})));
    items.sort((a, b) => a.time - b.time);
    for (const item of items) {
      if (item.seating) seat(item.seating); else applyEvent(item.event);
    }
    S.tokensSeen.push([S.now, S.metrics.generation_tokens_total || 0]);
    trim();
  }

  function request(seq) {
    let r = S.reqs.get(seq);
    if (!r) {  // arrived before the window this page started from
      r = {seq, id: `#${seq}`, arrival: null, prompt: null, waits: [], preempts: [], end: null,
           prefillChunks: 0, decoded: 0, lastSlot: null};
      S.reqs.set(seq, r);
    }
    return r;
  }

  function seat([step, start, end, entries]) {
    for (let i = 0; i < entries.length; i += 4) {
      const seq = entries[i], slot = entries[i + 1], tokens = entries[i + 2];
      const phase = entries[i + 3] === 1 ? "decode" : "prefill";
      const r = request(seq);
      const wait = r.waits[r.waits.length - 1];
      if (wait && wait[1] === null) wait[1] = start;
      r.lastSlot = slot;
      if (phase === "prefill") r.prefillChunks += 1; else r.decoded += 1;
      const last = S.open.get(seq);
      if (phase === "decode" && last && last.slot === slot && last.step === step - 1) {
        last.t1 = end; last.tokens += tokens; last.step = step;
        continue;
      }
      const seg = {seq, slot, t0: start, t1: end, phase, tokens, step};
      S.segs.push(seg);
      if (phase === "decode") S.open.set(seq, seg); else S.open.delete(seq);
    }
  }

  function applyEvent([, kind, seq, time, value, requestId, arrival, firstToken]) {
    const r = request(seq);
    r.id = requestId;
    r.arrival = arrival;
    if (kind === "arrive") {
      r.prompt = value;
      r.waits.push([arrival, null]);
      return;
    }
    S.open.delete(seq);
    if (kind === "preempt") {
      r.preempts.push({time, slot: r.lastSlot});
      r.waits.push([time, null]);
      return;
    }
    for (const w of r.waits) if (w[1] === null) w[1] = time;
    r.end = time; r.reason = kind; r.out = value;
    if (kind !== "abort" && firstToken !== null) {
      S.finished.push({
        time, ttft: firstToken - arrival, e2el: time - arrival,
        tpot: value > 1 ? (time - firstToken) / (value - 1) : null,
      });
    }
  }

  function trim() {
    const cut = S.now - KEEP_S;
    const keepFrom = (arr, key) => {
      let i = 0;
      while (i < arr.length && key(arr[i]) < cut) i++;
      if (i) arr.splice(0, i);
    };
    keepFrom(S.steps, s => s.time);
    keepFrom(S.finished, f => f.time);
    keepFrom(S.tokensSeen, t => t[0]);
    S.segs = S.segs.filter(s => s.t1 >= cut);
    for (const [seq, r] of S.reqs) if (r.end !== null && r.end < cut) S.reqs.delete(seq);
  }

  // -- numbers -------------------------------------------------------------------------------
  function percentile(values, p) {
    if (!values.length) return null;
    const v = values.slice().sort((a, b) => a - b);
    const k = (v.length - 1) * p / 100, lo = Math.floor(k), hi = Math.ceil(k);
    return v[lo] + (v[hi] - v[lo]) * (k - lo);
  }

  const fmtInt = v => Math.round(v).toLocaleString("en-US");
  function fmtSeconds(s) {
    if (s === null) return "–";
    return s < 1 ? `${(s * 1000).toFixed(s < 0.1 ? 1 : 0)} ms` : `${s.toFixed(s < 10 ? 2 : 1)} s`;
  }

  function renderNumbers() {
    for (const el of document.querySelectorAll("[data-metric]")) {
      const v = S.metrics[el.dataset.metric] ?? 0;  // a labelled counter is absent until counted
      el.dataset.value = String(v);
      el.textContent = el.dataset.format === "percent" ? `${(v * 100).toFixed(1)}%` : fmtInt(v);
    }
    for (const el of document.querySelectorAll("[data-setting]")) {
      el.textContent = S.settings[el.dataset.setting];
    }
    const last = S.steps[S.steps.length - 1];
    if (last) {
      const total = S.settings.num_kv_pages;
      document.getElementById("kv-detail").textContent =
        `${fmtInt(last.kv_pages_used)} used, ${fmtInt(last.kv_pages_cached)} cached, ` +
        `${fmtInt(total - last.kv_pages_used - last.kv_pages_cached)} free`;
    }
    const seen = S.tokensSeen, newest = seen[seen.length - 1];
    const then = seen.find(t => t[0] >= newest[0] - RATE_WINDOW_S);
    const rate = newest[0] > then[0] ? (newest[1] - then[1]) / (newest[0] - then[0]) : 0;
    setNumber("throughput", rate, rate.toFixed(1));

    const recent = S.finished.filter(f => f.time >= S.now - LATENCY_WINDOW_S);
    for (const key of ["ttft", "tpot", "e2el"]) {
      const values = recent.map(f => f[key]).filter(v => v !== null);
      const p50 = percentile(values, 50), p95 = percentile(values, 95);
      setNumber(key, p95, `${fmtSeconds(p50)} / ${fmtSeconds(p95)}`);
    }
    document.getElementById("latency-window").textContent =
      `${recent.length} requests, last ${LATENCY_WINDOW_S} s`;

    // Seats: how full the batch ran, and how often a seat sat empty while a request waited
    // (a static batch waiting for its longest request; pages or token budget running out).
    const seats = S.settings.max_num_seqs, win = visible(S.steps, s => s.time);
    let used = 0, idle = 0, contested = 0;
    win.forEach((s, i) => {
      used += s.num_scheduled;
      const before = i ? win[i - 1] : null;
      if (before && before.num_waiting > 0) { contested += seats; idle += seats - s.num_scheduled; }
    });
    const occupancy = win.length ? used / (seats * win.length) : 0;
    setNumber("occupancy", occupancy, `${(occupancy * 100).toFixed(0)}%`);
    const idleShare = contested ? idle / contested : 0;
    setNumber("idle-waiting", idleShare, `${(idleShare * 100).toFixed(0)}%`);

    const st = S.settings;
    document.getElementById("settings").innerHTML = [
      ["model", st.model], ["dtype", st.dtype], ["policy", st.policy],
      ["scheduling", st.scheduling_policy], ["max_num_seqs", st.max_num_seqs],
      ["max_num_batched_tokens", st.max_num_batched_tokens],
      ["KV", `${st.num_kv_pages} pages × ${st.block_size} tokens`],
      ["prefix caching", st.enable_prefix_caching ? "on" : "off"],
      ["max_model_len", st.max_model_len],
    ].map(([k, v]) => `<span>${k} <b>${escapeHtml(String(v))}</b></span>`).join("");
  }

  function setNumber(id, raw, text) {
    const el = document.getElementById(id);
    el.dataset.value = raw === null ? "" : String(raw);
    el.textContent = text;
  }

  const escapeHtml = s => s.replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                       '"': "&quot;"}[c]));

  // -- the timeline --------------------------------------------------------------------------
  const ui = {
    lanes: document.getElementById("lanes"), window: document.getElementById("window"),
    pause: document.getElementById("pause"), status: document.getElementById("status"),
    tooltip: document.getElementById("tooltip"),
  };
  // "fit": from the oldest step the page holds (at most KEEP_S) to now
  const windowSeconds = () => (ui.window.value === "fit"
    ? Math.max(5, S.now - (S.steps.length ? S.steps[0].time - S.steps[0].duration : S.now))
    : Number(ui.window.value));
  const visible = (arr, key) => arr.filter(x => key(x) >= S.now - windowSeconds());

  // Which lanes the timeline shows: one per seat, or one per request alive in the window.
  function laneView() {
    if (ui.lanes.value === "seats") {
      const n = S.settings ? S.settings.max_num_seqs : 1;
      return {count: n, of: seg => seg.slot, label: i => `seat ${i}`, rows: null};
    }
    const from = S.now - windowSeconds();
    const rows = [...S.reqs.values()]
      .filter(r => (r.end === null || r.end >= from) && (r.arrival !== null || r.end !== null))
      .sort((a, b) => a.seq - b.seq).slice(-MAX_REQUEST_LANES);
    const index = new Map(rows.map((r, i) => [r.seq, i]));
    return {count: Math.max(rows.length, 1), of: seg => index.get(seg.seq),
            label: i => (rows[i] ? shortId(rows[i].id) : ""), rows, index};
  }
  const shortId = id => (id.length > 11 ? `…${id.slice(-9)}` : id);

  let view = {count: 1, of: () => 0, label: () => "", rows: null};

  function drawTimeline(u) {
    const ctx = u.ctx, {left, top, width, height} = u.bbox;
    const x = t => u.valToPos(t, "x", true);
    const laneH = height / view.count, gap = laneH > 6 ? Math.max(1, laneH * 0.12) : 0;
    const yOf = lane => top + lane * laneH;
    ctx.save();
    ctx.beginPath(); ctx.rect(left, top, width, height); ctx.clip();
    for (let i = 0; i < view.count; i++) {  // empty seats: the background every bar sits on
      ctx.fillStyle = COLOR.idle;
      ctx.fillRect(left, yOf(i) + gap / 2, width, laneH - gap);
    }
    const from = S.now - windowSeconds();
    if (view.rows) {  // queue waits, only meaningful per request
      ctx.fillStyle = COLOR.queued;
      view.rows.forEach((r, lane) => {
        for (const [w0, w1] of r.waits) {
          const end = w1 === null ? S.now : w1;
          if (end < from) continue;
          ctx.fillRect(x(w0), yOf(lane) + gap / 2, Math.max(1, x(end) - x(w0)), laneH - gap);
        }
      });
    }
    let drawn = 0;
    for (const seg of S.segs) {
      if (seg.t1 < from) continue;
      const lane = view.of(seg);
      if (lane === undefined) continue;
      ctx.fillStyle = seg.phase === "prefill" ? COLOR.prefill
        : (seg.seq % 2 ? COLOR.decodeAlt : COLOR.decode);
      const x0 = x(seg.t0), w = Math.max(1, x(seg.t1) - x0 - (seg.phase === "prefill" ? 1 : 0));
      ctx.fillRect(x0, yOf(lane) + gap / 2, w, laneH - gap);
      drawn++;
    }
    ctx.fillStyle = COLOR.preempt;
    for (const r of S.reqs.values()) {
      for (const p of r.preempts) {
        if (p.time < from) continue;
        const lane = view.rows ? view.index.get(r.seq) : p.slot;
        if (lane === undefined || lane === null) continue;
        ctx.fillRect(x(p.time) - 1, yOf(lane), 3, laneH);
      }
    }
    ctx.restore();
    S.drawn = drawn;
  }

  function laneSplits() {
    const every = Math.ceil(view.count / 24);
    const splits = [];
    for (let i = 0; i < view.count; i += every) splits.push(view.count - i - 0.5);
    return splits;
  }

  const relativeTime = (u, splits) => {
    const digits = splits.length > 1 && splits[1] - splits[0] < 1 ? 1 : 0;
    return splits.map(v => {
      const d = v - S.now;
      return Math.abs(d) < 0.05 ? "now" : `${d.toFixed(digits)} s`;
    });
  };
  const xRange = () => [S.now - windowSeconds(), S.now];
  const axis = extra => Object.assign({stroke: COLOR.muted, grid: {stroke: COLOR.border, width: 1},
                                       ticks: {stroke: COLOR.border, width: 1}}, extra);

  function chartWidth(el) { return Math.max(300, el.clientWidth); }

  const timelineEl = document.getElementById("timeline");
  const timeline = new uPlot({
    width: chartWidth(timelineEl), height: 380, legend: {show: false},
    cursor: {y: false, points: {show: false}, drag: {x: false, y: false}},
    scales: {x: {time: false, range: xRange}, y: {range: () => [0, view.count]}},
    axes: [axis({values: relativeTime}),
           axis({size: 90, grid: {show: false}, splits: laneSplits,
                 values: (u, splits) => splits.map(v => view.label(Math.round(view.count - v - 0.5)))})],
    series: [{}, {show: false}],
    hooks: {draw: [drawTimeline], setCursor: [showTooltip]},
  }, [[0, 1], [null, null]], timelineEl);

  function showTooltip(u) {
    const {left, top} = u.cursor;
    if (left === undefined || left < 0) { ui.tooltip.hidden = true; return; }
    const t = u.posToVal(left, "x"), lane = Math.floor(top / (u.bbox.height / devicePixelRatio / view.count));
    const seg = S.segs.find(s => view.of(s) === lane && s.t0 <= t && t <= s.t1);
    const r = seg ? S.reqs.get(seg.seq) : (view.rows ? view.rows[lane] : null);
    if (!r) { ui.tooltip.hidden = true; return; }
    const firstSeat = r.waits.length && r.waits[0][1] !== null ? r.waits[0][1] : null;
    const lines = [r.id];
    if (r.prompt !== null) lines.push(`prompt ${r.prompt} tokens`);
    if (firstSeat !== null && r.arrival !== null) lines.push(`queued ${fmtSeconds(firstSeat - r.arrival)}`);
    lines.push(`prefill ${r.prefillChunks} chunk(s), ${r.decoded} decode steps`);
    if (r.preempts.length) lines.push(`preempted ${r.preempts.length}×`);
    lines.push(r.end === null ? "running" : `finished: ${r.reason}, ${r.out} tokens`);
    if (seg) lines.push(`this bar: ${seg.phase}, ${seg.tokens} tokens`);
    ui.tooltip.textContent = lines.join("\n");
    ui.tooltip.style.left = `${left + u.bbox.left / devicePixelRatio + 24}px`;
    ui.tooltip.style.top = `${top + 40}px`;
    ui.tooltip.hidden = false;
  }

  // -- the per-step charts -------------------------------------------------------------------
  function lineChart(id, series) {
    const el = document.getElementById(id);
    return new uPlot({
      width: chartWidth(el), height: 220,
      cursor: {points: {size: 4}, drag: {x: false, y: false}},
      scales: {x: {time: false, range: xRange}},
      axes: [axis({values: relativeTime}), axis({size: 64})],
      series: [{label: "t", value: (u, v) => (v === null ? "–" : `${(v - S.now).toFixed(1)} s`)},
               ...series.map(([label, stroke, fill]) => ({label, stroke, width: 1.5,
                                                          fill, points: {show: false}}))],
    }, [[], ...series.map(() => [])], el);
  }

  const batchChart = lineChart("batch-chart", [
    ["in the batch", COLOR.running, null], ["holding a seat", COLOR.decode, null],
    ["waiting", COLOR.waiting, null]]);
  const kvChart = lineChart("kv-chart", [
    ["in use", COLOR.decode, "#5794f233"], ["cached", COLOR.running, null],
    ["free", COLOR.muted, null]]);
  const tokensChart = lineChart("tokens-chart", [
    ["decode", COLOR.decode, "#5794f233"], ["prefill", COLOR.prefill, null]]);

  function renderCharts() {
    const steps = visible(S.steps, s => s.time);
    const total = S.settings.num_kv_pages;
    batchChart.setData([steps.map(s => s.time), steps.map(s => s.num_scheduled),
                        steps.map(s => s.num_running), steps.map(s => s.num_waiting)]);
    kvChart.setData([steps.map(s => s.time), steps.map(s => s.kv_pages_used),
                     steps.map(s => s.kv_pages_cached),
                     steps.map(s => total - s.kv_pages_used - s.kv_pages_cached)]);
    // tokens per whole second of server time; the second still running is left out
    const buckets = new Map();
    for (const s of steps) {
      const sec = Math.floor(s.time);
      if (sec >= Math.floor(S.now)) continue;
      const b = buckets.get(sec) || [0, 0];
      b[0] += s.num_decode_tokens; b[1] += s.num_prefill_tokens;
      buckets.set(sec, b);
    }
    const secs = [...buckets.keys()].sort((a, b) => a - b);
    tokensChart.setData([secs.map(s => s + 1), secs.map(s => buckets.get(s)[0]),
                         secs.map(s => buckets.get(s)[1])]);
    view = laneView();
    timeline.setData([xRange(), [null, null]]);
  }

  // -- the loop ------------------------------------------------------------------------------
  // A server started with --api-key wants it on the feed too: taken from the address
  // (.../dashboard#key=...) or asked for once, and kept for this tab only.
  function authHeaders() {
    const given = location.hash.match(/key=([^&]+)/);
    if (given) sessionStorage.setItem("conveyor-api-key", decodeURIComponent(given[1]));
    const key = sessionStorage.getItem("conveyor-api-key");
    return key ? {Authorization: `Bearer ${key}`} : {};
  }

  async function poll() {
    const first = S.updates === 0;
    const url = `/v1/engine/dashboard?since_step=${S.nextStep}&since_event=${S.nextEvent}` +
      (first ? `&window=${KEEP_S}` : "");
    try {
      const response = await fetch(url, {cache: "no-store", headers: authHeaders()});
      if (response.status === 401) {
        const key = window.prompt("This server needs its API key:");
        if (key) sessionStorage.setItem("conveyor-api-key", key);
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const feed = await response.json();
      const t0 = performance.now();
      ingest(feed);
      S.updates += 1;
      if (!ui.pause.checked) { renderNumbers(); renderCharts(); }
      S.renderMs.push(performance.now() - t0);
      if (S.renderMs.length > 600) S.renderMs.shift();
      ui.status.classList.remove("stale");
      ui.status.textContent = `step ${fmtInt(S.nextStep)} · updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      ui.status.classList.add("stale");
      ui.status.textContent = `no answer from the server (${err.message}); retrying`;
    }
    setTimeout(poll, POLL_MS);
  }

  function resize() {
    for (const [chart, id] of [[timeline, "timeline"], [batchChart, "batch-chart"],
                               [kvChart, "kv-chart"], [tokensChart, "tokens-chart"]]) {
      chart.setSize({width: chartWidth(document.getElementById(id)), height: chart.height});
    }
  }
  window.addEventListener("resize", resize);
  for (const el of [ui.lanes, ui.window]) el.addEventListener("change", () => S.settings && renderCharts());

  window.conveyorDashboard = S;  // for the browser test and the curious
  poll();
})();
