"""The router's Prometheus metrics: every decision, fallback, retry and rejection, and how
far the conductor's predicted cache hits are from what the engines report."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenization.prompt_encoder import PromptEncoder

from .policy import PrefillCostModel

# realized − predicted cached tokens: symmetric around 0 (le=0 minus le=-1 is "exact").
# With negative buckets no _sum is exported (OpenMetrics); the two counters give the net.
PREDICTION_ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)


class _EncoderCollector(Collector):
    """The prompt encoders' counters, per model, read at scrape time (they run in worker
    threads)."""

    def __init__(self) -> None:
        self.encoders: dict[str, PromptEncoder] = {}

    def collect(self) -> Iterable[Metric]:
        labels = ["model"]
        active = GaugeMetricFamily(
            "router_tokenizer_chunks_active",
            "1 while long prompts are encoded in chunks whose ids are reused, 0 when the "
            "tokenizer rules chunks out or once an audit found the router's ids differing "
            "from HF's whole ones (then HF encodes every prompt whole)",
            labels=labels,
        )
        fast = GaugeMetricFamily(
            "router_tokenizer_fast_bpe_active",
            "1 while prompts are encoded through tiktoken (a byte-level BPE tokenizer on "
            "which it gives HF's ids), 0 otherwise",
            labels=labels,
        )
        tokens = CounterMetricFamily(
            "router_tokenizer_chunk_tokens",
            "Token ids of chunked prompts: reused (a chunk seen before) or encoded",
            labels=[*labels, "source"],
        )
        audits = CounterMetricFamily(
            "router_tokenizer_chunk_audits",
            "The router's encodes (tiktoken or chunked) checked against HF's whole encode, "
            "by result",
            labels=[*labels, "result"],
        )
        cached = GaugeMetricFamily(
            "router_tokenizer_chunk_cache_tokens",
            "Token ids the chunk cache holds (at most tokenizer.chunk_cache_tokens)",
            labels=labels,
        )
        for model, encoder in self.encoders.items():
            stats = encoder.stats
            active.add_metric([model], int(encoder.active and encoder.chunking))
            fast.add_metric([model], int(encoder.active and encoder.fast is not None))
            tokens.add_metric([model, "reused"], stats.reused_tokens)
            tokens.add_metric([model, "encoded"], stats.encoded_tokens)
            audits.add_metric([model, "agreed"], stats.audits - stats.disagreements)
            audits.add_metric([model, "differed"], stats.disagreements)
            cached.add_metric([model], stats.cached_tokens)
        yield from (active, fast, tokens, audits, cached)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self._encoders = _EncoderCollector()
        registry.register(self._encoders)
        self.requests = Counter(
            "router_requests_total",
            "Requests answered, by route and HTTP status",
            ["route", "status"],
            registry=registry,
        )
        self.decisions = Counter(
            "router_decisions_total",
            "Routing decisions, by policy used and chosen prefill instance",
            ["policy", "instance"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "router_fallbacks_total",
            "Decisions made without the conductor (least_loaded instead)",
            ["reason"],
            registry=registry,
        )
        self.retries = Counter(
            "router_retries_total",
            "Requests retried on another instance after an upstream failure",
            ["instance"],
            registry=registry,
        )
        self.rejections = Counter(
            "router_rejections_total", "Requests rejected", ["reason"], registry=registry
        )
        self.cached_tokens = Counter(
            "router_cached_tokens_total",
            "Prompt tokens the chosen instances already held (per the decision)",
            registry=registry,
        )
        self.forgone_tokens = Counter(
            "router_cache_forgone_tokens_total",
            "Prompt tokens another instance held (on any tier) beyond the chosen one's hit: "
            "recomputed because the policy weighed load or cost over the longer prefix",
            registry=registry,
        )
        self.in_flight_hit_tokens = Counter(
            "router_in_flight_hit_tokens",
            "Cached tokens decisions counted beyond the conductor's answer: a prompt sharing "
            "the prefix was sent to the chosen instance and is running (or just ended)",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "router_prompt_tokens_total", "Prompt tokens routed", registry=registry
        )
        self.proxy_seconds = Histogram(
            "router_overhead_seconds",
            "Time spent in the router before the request is forwarded (reading the body, "
            "tokenizing, the conductor's answer, the choice)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
            registry=registry,
        )
        self.tokenized = Counter(
            "router_tokenize_total",
            "Prompts by where their token ids came from: given (token ids in the request), "
            "local (the router's own tokenizer), engine (an engine's /tokenize), none",
            ["path"],
            registry=registry,
        )
        self.local_skipped = Counter(
            "router_tokenize_local_skipped_total",
            "Prompts the router's tokenizer left to an engine's /tokenize, by reason "
            "(a request field, content or template it does not reproduce exactly)",
            ["reason"],
            registry=registry,
        )
        self.local_tokenizer = Gauge(
            "router_local_tokenizer_active",
            "1 while the router tokenizes this path of the model's prompts itself (after an "
            "engine's /tokenize agreed with it on the probe prompts)",
            ["path", "model"],
            registry=registry,
        )
        self.conductor_query_seconds = Histogram(
            "router_conductor_query_seconds",
            "A conductor /query as the router waits for it (failed ones included)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
            registry=registry,
        )
        self.ttft_seconds = Histogram(
            "router_time_to_first_token_seconds",
            "Time from receiving the request to its first byte from upstream",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.in_flight = Gauge(
            "router_in_flight_requests", "Requests in flight", ["instance"], registry=registry
        )
        self.healthy = Gauge(
            "router_upstream_healthy",
            "1 when the upstream is in rotation",
            ["instance"],
            registry=registry,
        )
        self.cache_predicted = Counter(
            "router_cache_predicted_tokens_total",
            "Cached prompt tokens the conductor predicted, for answers whose engine "
            "reported its own count (prefill instance)",
            ["instance"],
            registry=registry,
        )
        self.cache_realized = Counter(
            "router_cache_realized_tokens_total",
            "Cached prompt tokens the engine reported (usage.prompt_tokens_details), for "
            "the same answers",
            ["instance"],
            registry=registry,
        )
        self.cache_prediction_error = Histogram(
            "router_cache_prediction_error_tokens",
            "Per answer: engine-reported minus predicted cached prompt tokens (negative: "
            "the index promised a prefix the engine no longer held)",
            ["instance"],
            buckets=PREDICTION_ERROR_BUCKETS,
            registry=registry,
        )
        self.store_up = Gauge(
            "router_kv_store_up",
            "1 while loads from the Mooncake store are priced (the conductor reports it up "
            "or has not checked it yet), 0 while it reports it down: no load is priced and "
            "no prefix is pulled through it",
            ["kv_store"],
            registry=registry,
        )
        self.cost_model = Gauge(
            "router_cost_model",
            "The cost model the ttft policy prices a model's requests with (configured, then "
            "learned)",
            ["parameter", "model"],
            registry=registry,
        )
        self.cache_unverified = Counter(
            "router_cache_unverified_answers_total",
            "Answers without a cached-token count to compare (e.g. streams without "
            "stream_options.include_usage)",
            ["instance"],
            registry=registry,
        )

        self.task_failures = Counter(
            "router_task_failures_total",
            "Background task failures (each logged, then the task restarted with backoff)",
            ["task"],
            registry=registry,
        )
        self.rejected_values = Counter(
            "router_engine_values_rejected_total",
            "Numbers and answers from engines that were ignored: not finite, out of range or "
            "not of the expected shape (ttft_header, metrics_line, metrics_value, "
            "cached_tokens, tokenize_answer)",
            ["value"],
            registry=registry,
        )
        self.timeouts = Counter(
            "router_upstream_timeouts_total",
            "Upstream calls that timed out, by stage (tokenize, stream_headers, first_byte, idle)",
            ["instance", "stage"],
            registry=registry,
        )

    def watch_encoder(self, model: str, encoder: PromptEncoder) -> None:
        """Export ``model``'s prompt encoder's counters."""
        self._encoders.encoders[model] = encoder

    def rejected(self, value: str, count: int = 1) -> None:
        """``count`` numbers or answers of kind ``value`` an engine sent were ignored."""
        if count:
            self.rejected_values.labels(value).inc(count)

    def publish_cost_model(self, model: str, cost: PrefillCostModel) -> None:
        for name in ("per_token_s", "store_bytes_per_token", "store_bandwidth_bytes_s"):
            self.cost_model.labels(name, model).set(getattr(cost, name))

    def record_cache_use(self, instance: str, predicted: int, realized: int | None) -> None:
        """One answered request: the conductor's prediction against the engine's report."""
        if realized is None:
            self.cache_unverified.labels(instance).inc()
            return
        self.cache_predicted.labels(instance).inc(predicted)
        self.cache_realized.labels(instance).inc(realized)
        self.cache_prediction_error.labels(instance).observe(realized - predicted)


class ReplicaMetrics:
    """How this router shares what it routed with the other replicas (through the
    conductors' ``/routed``): on a registry of the conductor client's, rendered with the
    index's series (``IndexClient.exposition``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reports = Counter(
            "router_routed_reports_total",
            "Routed prompts reported to each conductor, by outcome: sent, or failed (the "
            "conductor did not take it: the other replicas do not see it there)",
            ["conductor", "outcome"],
            registry=self.registry,
        )
        self.dropped = Counter(
            "router_routed_reports_dropped_total",
            "Routed prompts never reported: the queue of reports was full (conductors slow)",
            registry=self.registry,
        )
        self.load_reports = Counter(
            "router_load_reports_total",
            "Reports of this router's load per instance to each conductor (POST /loads), by "
            "outcome: sent, or failed (the other replicas do not see its load there)",
            ["conductor", "outcome"],
            registry=self.registry,
        )
        self.load_sharing = Gauge(
            "router_load_sharing",
            "1 while the conductor takes this router's load reports, 0 while they fail (the "
            "router then prices queues from what it sent itself)",
            ["conductor"],
            registry=self.registry,
        )
        self.sharing = Gauge(
            "router_routed_sharing",
            "1 while the conductor takes this router's routed prompts, 0 while its reports "
            "fail (the router then routes on what it sent itself)",
            ["conductor"],
            registry=self.registry,
        )
