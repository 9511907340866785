"""Prometheus metrics with vLLM's meanings under a ``conveyor:`` prefix, or under vLLM's own
names (``--metrics-prefix vllm``: ``vllm:num_requests_running``, ...) for its dashboards and
routers.

Each server owns a private registry, so two servers (or tests) in one process never share
counters. Only the engine thread writes; prometheus_client makes reads from /metrics safe. No
``*_created`` series (vLLM turns them off too); the process's own series (``process_*``:
memory, CPU seconds, open files) beside them.
"""

from __future__ import annotations

import itertools

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               disable_created_metrics, generate_latest)

from conveyor.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0)

disable_created_metrics()


# a request's finish reason where its samples' differ: the first of these any of them has
_SEVERITY = ("error", "abort", "length", "stop")


def token_buckets(most: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to ``most``."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > most:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 1 << 20,
                 prefix: str = "conveyor") -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        self.prefix = prefix + ":"
        self._preemptions_seen = 0

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(self.prefix + name, doc, ["model_name"],
                         registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(self.prefix + name, doc, ["model_name"],
                           registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(self.prefix + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV pages in use (0..1).")
        self.batch_size = gauge("iteration_batch_size", "Sequences scheduled in the last step.")
        self.preemptions = counter("num_preemptions", "Preemptions (by recompute) so far.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._prefix_seen = (0, 0)
        self.grammar_matchers = counter("structured_output_sequences",
                                        "Sequences constrained by a grammar (one matcher each).")
        self.grammar_compiles = counter("grammar_compiles", "Grammars compiled; the other "
                                        "constrained sequences took theirs from the cache.")
        self.grammar_seconds = counter("grammar_compile_seconds", "Time spent compiling.")
        self._grammar_seen = (0, 0, 0.0)
        self._success = Counter(self.prefix + "request_success", "Finished requests by finish reason "
                                "(a request of n samples counts once: 'error' or 'abort' if a "
                                "sample ended so, else 'length' if one did, else 'stop').",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._sample_success = Counter(self.prefix + "request_sample_success", "Finished samples "
                                       "(each of a request's n) by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time between output tokens of a request.", _TPOT_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds",
                                     "Time between a request's successive steps with output "
                                     "tokens.", _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First scheduled to first token.")
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.")
        lengths = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt tokens of each finished request.", lengths)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated for each finished request (all of "
            "its samples).", lengths)
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens scheduled in each engine step.",
                                          token_buckets(1 << 14))
        self.moe_seconds = counter("moe_layer_seconds", "Time in the mixture-of-experts layers "
                                   "(router and experts), all of them (MoE models only).")
        self.moe_experts = histogram("iteration_moe_experts", "Distinct experts a MoE layer ran "
                                     "in each engine step, on average over the layers (MoE "
                                     "models only).", token_buckets(1 << 10))
        self._steps_seen = 0

    def observe_engine(self, engine) -> None:
        """Refresh the gauges from the engine's state, and observe the steps since the last
        call (engine thread only)."""
        new = min(engine.num_steps - self._steps_seen, len(engine.steps))
        for step in itertools.islice(reversed(engine.steps), new):
            self.iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens)
            if step.moe_experts:
                self.moe_seconds.inc(step.moe_seconds)
                self.moe_experts.observe(step.moe_experts)
        self._steps_seen = engine.num_steps
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(sched.kv.pool.usage)
        self.batch_size.set(engine.last_batch_size)
        queries, hits = sched.kv.prefix_queries, sched.kv.prefix_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        g = engine.grammars.stats
        seen = (g.matchers, g.compiles, g.compile_seconds_total)
        for metric, now, before in zip((self.grammar_matchers, self.grammar_compiles,
                                        self.grammar_seconds), seen, self._grammar_seen):
            if now != before:
                metric.inc(now - before)
        self._grammar_seen = seen
        new_preemptions = sched.num_preemptions_total - self._preemptions_seen
        if new_preemptions:
            self.preemptions.inc(new_preemptions)
            self._preemptions_seen = sched.num_preemptions_total

    def count_finish(self, reasons: list[str]) -> None:
        """One request's end: its samples' finish reasons."""
        for reason in reasons:
            self._sample_success.labels(self.model_name, reason).inc()
        worst = min(reasons, key=lambda r: _SEVERITY.index(r) if r in _SEVERITY else -1)
        self._success.labels(self.model_name, worst).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.count_finish([c.finish_reason or "abort" for c in out.outputs])
        if m.finished_time is None:
            return
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        decode = m.finished_time - m.first_token_time
        self.decode_time.observe(decode)
        longest = max(len(c.token_ids) for c in out.outputs)
        if longest > 1:
            self.tpot.observe(decode / (longest - 1))

    def snapshot(self) -> dict[str, float]:
        """Every counter and gauge as /metrics shows it at this moment, summed over labels, by
        name without the prefix (counters keep their ``_total``)."""
        values: dict[str, float] = {}
        for family in self.registry.collect():
            if family.type not in ("counter", "gauge"):
                continue
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    name = sample.name.removeprefix(self.prefix)
                    values[name] = values.get(name, 0.0) + sample.value
        return values

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
