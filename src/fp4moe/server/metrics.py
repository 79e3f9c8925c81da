"""Prometheus metrics with vLLM-like names (``fp4moe:`` prefix instead of ``vllm:``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge(
            "fp4moe:num_requests_running", "Sequences in the running batch.", labels, registry=r
        )
        self.waiting = Gauge(
            "fp4moe:num_requests_waiting", "Sequences waiting to be scheduled.", labels, registry=r
        )
        self.kv_usage = Gauge(
            "fp4moe:kv_cache_usage_perc", "Cached tokens / cache budget (0-1).", labels, registry=r
        )
        self.preemptions = Gauge(
            "fp4moe:num_preemptions", "Sequences preempted (recomputed) so far.", labels, registry=r
        )
        self.prompt_tokens = Counter("fp4moe:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("fp4moe:generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter("fp4moe:request_success", "Sequences finished.", labels, registry=r)
        self.aborted = Counter(
            "fp4moe:request_aborted", "Sequences aborted (client gone, shutdown).", labels, registry=r
        )
        self.steps = Counter("fp4moe:engine_steps", "Engine steps launched.", labels, registry=r)
        self.async_steps = Counter(
            "fp4moe:engine_async_steps",
            "Decode steps launched before the previous step's tokens were read back (async scheduling).",
            labels,
            registry=r,
        )
        self.prefix_queries = Counter(
            "fp4moe:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self.prefix_hits = Counter(
            "fp4moe:prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels, registry=r
        )
        self.spec = {
            key: Counter(f"fp4moe:spec_decode_num_{key}", help_, labels, registry=r)
            for key, help_ in (
                ("drafts", "Draft-and-verify rounds."),
                ("draft_tokens", "Tokens drafted by the MTP head."),
                ("accepted_tokens", "Drafted tokens the target accepted."),
                ("backoffs", "Times a sequence stopped drafting for a while: its drafts did not pay."),
                (
                    "started_backed_off",
                    "Requests that started without drafts: the latest rounds did not pay.",
                ),
                (
                    "batch_backoffs",
                    "Times a batch stopped drafting for a while: its rounds served fewer tokens a second than "
                    "plain steps at its size.",
                ),
            )
        }
        self.spec_per_pos = Counter(
            "fp4moe:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by position in the draft.",
            [*labels, "position"],
            registry=r,
        )
        self._spec_seen: dict[str, int] = {}
        self.compiles = Counter(
            "fp4moe:kernel_compiles_after_warmup",
            "Triton kernels compiled after the warm-up (each one a request that waited for the compiler).",
            [*labels, "kernel"],
            registry=r,
        )
        self._compiles_seen: dict[str, int] = {}
        self.ttft = Histogram(
            "fp4moe:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "fp4moe:inter_token_latency_seconds",
            "Time between tokens.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "fp4moe:e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.model_name = model_name
        self._seen: dict[str, int] = {}  # the engine's counters at the last render

    def render(self, snap: dict) -> bytes:
        """Fold an engine snapshot's counters and latency samples in (``EngineCore.snapshot``), then render
        the text format."""
        m = self.model_name
        self.running.labels(m).set(snap["running"])
        self.waiting.labels(m).set(snap["waiting"])
        self.kv_usage.labels(m).set(snap["kv_usage"])
        self.preemptions.labels(m).set(snap["preemptions"])
        for key, counter in (
            ("prompt", self.prompt_tokens),
            ("generation", self.generation_tokens),
            ("success", self.success),
            ("aborted", self.aborted),
            ("steps", self.steps),
            ("async_steps", self.async_steps),
            ("prefix_queries", self.prefix_queries),
            ("prefix_hits", self.prefix_hits),
        ):
            counter.labels(m).inc(snap[key] - self._seen.get(key, 0))
            self._seen[key] = snap[key]
        for key, value in (snap["spec"] or {}).items():
            delta = value - self._spec_seen.get(key, 0)
            self._spec_seen[key] = value
            if key.startswith("pos"):
                self.spec_per_pos.labels(m, key[3:]).inc(delta)
            else:
                self.spec[key].labels(m).inc(delta)
        for kernel, n in snap["compiles"].items():
            self.compiles.labels(m, kernel).inc(n - self._compiles_seen.get(kernel, 0))
            self._compiles_seen[kernel] = n
        for hist, name in ((self.ttft, "ttft"), (self.itl, "itl"), (self.e2e, "e2e")):
            for v in snap[name]:
                hist.labels(m).observe(v)
        return generate_latest(self.registry)
