"""The simulator's ``/metrics``: vLLM 0.32's request, token and cache metrics.

Dashboards, autoscalers and routers scrape vLLM by metric name, so every ``vllm:`` family
here has real vLLM's name, type, labels (``model_name``, ``engine`` = the DP rank, plus
``finished_reason``, ``source``, ``reason``, ``sleep_state`` where vLLM has them) and
histogram buckets; the test suite compares them with a real engine's answer. Latencies are
measured on the engine's model clock, like the ``x-engine-ttft-ms`` header. Families only
the simulator has start with ``sim_``.

State (queues, cache usage, cumulative counters the scheduler keeps) is read at scrape
time; per-request observations arrive through ``EngineMetrics.step`` (each engine step)
and ``EngineMetrics.finished`` (a request ended outside a step: abort, stop string).

With LoRA (``max_loras`` given) there is vLLM's ``vllm:lora_requests_info`` too: a gauge
whose labels name the adapters with requests in the engine (in the order they came) and
whose value is when that set was last seen, one series per set ever seen, as vLLM's is
(routers read the adapters an engine has loaded from it). Every other family is labelled
with the base model's name only, adapters' requests included, as vLLM's are.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .scheduler import EngineRequest, Scheduler, StepPlan

LATENCY_BUCKETS = (  # e2e, queue, prefill, decode and inference time
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (  # inter-token latency, time per output token
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to ``max_model_len`` (prompt and generation token counts)."""
    buckets: list[float] = []
    mantissas, exponent = (1, 2, 5), 0
    while True:
        for mantissa in mantissas:
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def cache_config_info(
    *,
    block_size: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    num_gpu_blocks_override: int | None,
    gpu_memory_utilization: float,
    prefix_caching_hash_algo: str,
    kv_bytes_per_token: float,
    max_model_len: int,
) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels (vLLM's CacheConfig, stringified as vLLM does)."""
    tokens = num_gpu_blocks * block_size
    return {
        "_block_size_resolved": "True",
        "block_size": str(block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(tokens / max_model_len),
        "kv_cache_memory_bytes": str(int(tokens * kv_bytes_per_token)),
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": str(num_cpu_blocks or None),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(num_gpu_blocks_override),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": prefix_caching_hash_algo,
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


class EngineMetrics:
    """One engine's registry; ``labels`` are vLLM's ``model_name`` and ``engine``."""

    def __init__(
        self,
        scheduler: Scheduler,
        labels: dict[str, str],
        max_model_len: int,
        cache_config: dict[str, str],
        max_loras: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(scheduler, labels, cache_config))
        self._lora_info = None if max_loras is None else _LoraRequestsInfo(scheduler, max_loras)
        if self._lora_info is not None:
            self.registry.register(self._lora_info)
        self._labels = labels
        self._last_token: dict[str, float] = {}  # request id -> model time of its last token
        names = list(labels)
        tokens = token_buckets(max_model_len)

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            family = Histogram(name, documentation, names, buckets=buckets, registry=self.registry)
            return family.labels(**labels)

        def counter(name: str, documentation: str, extra: str | None = None) -> Counter:
            return Counter(name, documentation, names + ([extra] if extra else []),
                           registry=self.registry)  # fmt: skip

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source"
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", "finished_reason"
        )
        for reason in FINISHED_REASONS:  # vLLM exports every reason from the start
            self.request_success.labels(**labels, finished_reason=reason)
        for source in PROMPT_SOURCES:
            self.prompt_tokens_by_source.labels(**labels, source=source)
        self.prompt_tokens.labels(**labels)
        self.prompt_tokens_cached.labels(**labels)

        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS,
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tokens,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        self.num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTION_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )

    def step(self, plan: StepPlan, changed: Iterable[EngineRequest], clock: float) -> None:
        """Observe an engine step that ended at model time ``clock``."""
        self.iteration_tokens.observe(plan.num_computed_tokens)
        if self._lora_info is not None:
            self._lora_info.step(plan)
        for request in changed:
            if request.output_token_ids:
                self._token(request, clock)
            if request.finished:
                self.finished(request)

    def finished(self, request: EngineRequest) -> None:
        """Observe a request that ended, whatever the reason, once."""
        self._last_token.pop(request.request_id, None)
        self.request_success.labels(**self._labels, finished_reason=request.finish_reason).inc()
        num_generated = len(request.output_token_ids)
        self.request_prompt_tokens.observe(len(request.prompt_token_ids))
        self.request_generation_tokens.observe(num_generated)
        self.params_max_tokens.observe(request.max_tokens)
        group = request.group
        if group is None:
            self.params_n.observe(1)
            self.max_generation_tokens.observe(num_generated)
        elif group.finish(num_generated):  # vLLM observes a prompt's n samples once
            self.params_n.observe(group.n)
            self.max_generation_tokens.observe(group.max_generated)
        self.num_preemptions.observe(request.num_preemptions)
        finish, first = request.finish_time, request.first_token_time
        scheduled = request.scheduled_time
        if finish is None:
            return
        self.e2e.observe(finish - request.arrival_time)
        if scheduled is None:
            return
        self.queue_time.observe(scheduled - request.arrival_time)
        self.inference_time.observe(finish - scheduled)
        self.prefill_kv_computed.observe(len(request.prompt_token_ids) - request.num_cached_tokens)
        if first is None:
            return
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(finish - first)
        if num_generated > 1:
            self.tpot.observe((finish - first) / (num_generated - 1))

    def _token(self, request: EngineRequest, clock: float) -> None:
        """A token sampled at ``clock``: the first counts the prompt, later ones the ITL."""
        last = self._last_token.get(request.request_id)
        self._last_token[request.request_id] = clock
        if last is not None:
            self.itl.observe(clock - last)
            return
        assert request.ttft is not None
        self.ttft.observe(request.ttft)
        num_prompt = len(request.prompt_token_ids)
        cached = request.num_cached_tokens
        external = cached if request.remote_prefill else request.num_external_cached_tokens
        sources = {
            "local_compute": num_prompt - cached,
            "local_cache_hit": cached - external,
            "external_kv_transfer": external,
        }
        self.prompt_tokens.labels(**self._labels).inc(num_prompt)
        self.prompt_tokens_cached.labels(**self._labels).inc(cached)
        for source, count in sources.items():
            self.prompt_tokens_by_source.labels(**self._labels, source=source).inc(count)


class _StateCollector(Collector):
    """Engine state read at scrape time, under vLLM's names where vLLM has the metric."""

    def __init__(
        self, scheduler: Scheduler, labels: dict[str, str], cache_config: dict[str, str]
    ) -> None:
        self._scheduler = scheduler
        self._labels = labels
        self._cache_config = cache_config

    def collect(self) -> Iterable[Metric]:
        scheduler = self._scheduler
        blocks = scheduler.blocks
        stats = blocks.stats
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             len(scheduler.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             len(scheduler.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             blocks.usage),
            ("sim_kv_cache_free_blocks", "GPU blocks free or evictable", blocks.num_free_blocks),
            ("sim_kv_cache_total_blocks", "GPU blocks in the pool", blocks.num_gpu_blocks),
            ("sim_kv_transfer_held_requests", "Prefills awaiting a pull", len(scheduler.held)),
            ("sim_model_clock_seconds", "Simulated GPU time elapsed", scheduler.clock),
        )  # fmt: skip
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", stats.query_tokens),
            ("vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", stats.gpu_hit_tokens),
            ("vllm:external_prefix_cache_queries",
             "External prefix cache queries from KV connector cross-instance cache sharing, "
             "in terms of number of queried tokens.", stats.external_query_tokens),
            ("vllm:external_prefix_cache_hits",
             "External prefix cache hits from KV connector cross-instance cache sharing, "
             "in terms of number of cached tokens.", stats.external_hit_tokens),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             scheduler.num_preemptions),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             scheduler.num_generated_tokens),
            ("sim_cpu_prefix_cache_hits", "Prompt tokens hit on the CPU", stats.cpu_hit_tokens),
        )  # fmt: skip
        names, values = list(self._labels), list(self._labels.values())
        for family, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, documentation, value in rows:
                metric = family(name, documentation, labels=names)
                metric.add_metric(values, value)
                yield metric
        yield self._labelled(
            GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                              "Number of waiting requests by reason.", labels=[*names, "reason"]),
            {"capacity": len(scheduler.waiting), "deferred": 0},
        )  # fmt: skip
        yield self._labelled(
            GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state.",
                              labels=[*names, "sleep_state"]),
            {"awake": 1, "weights_offloaded": 0, "discard_all": 0},
        )  # fmt: skip
        cached = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            labels=[*names, "source"],
        )
        yield self._labelled(
            cached,
            {"device": stats.gpu_hit_tokens, "host": stats.cpu_hit_tokens}
            | {"disk": 0, "p2p": 0, "external_unspecified": stats.external_hit_tokens},
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["engine", *self._cache_config],
        )
        info.add_metric([self._labels["engine"], *self._cache_config.values()], 1)
        yield info

    def _labelled(self, metric: GaugeMetricFamily | CounterMetricFamily,
                  values: dict[str, float]) -> Metric:  # fmt: skip
        """One sample per value of the family's last label."""
        for label, value in values.items():
            metric.add_metric([*self._labels.values(), label], value)
        return metric


class _LoraRequestsInfo(Collector):
    """``vllm:lora_requests_info``: vLLM sets it to the current time, at each step, for the
    label set naming the adapters with requests in the engine (waiting and running list the
    same adapters: those with any request), so every set seen keeps a series."""

    def __init__(self, scheduler: Scheduler, max_loras: int) -> None:
        self._scheduler = scheduler
        self._max_lora = str(max_loras)
        self._adapters: dict[str, None] = {}  # in flight, in the order they came
        self._seen: dict[str, float] = {}  # adapters joined by "," -> when last seen

    def step(self, plan: StepPlan) -> None:
        """The adapters of the step's requests and of those still in the engine."""
        scheduler = self._scheduler
        requests = (*(chunk.request for chunk in plan.chunks), *scheduler.running,
                    *scheduler.waiting)  # fmt: skip
        names = dict.fromkeys(r.lora.name for r in requests if r.lora is not None)
        self._adapters = {name: None for name in self._adapters if name in names} | names
        self._seen[",".join(self._adapters)] = time.time()

    def collect(self) -> Iterable[Metric]:
        labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
        metric = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.", labels=labels
        )
        for adapters, seen in self._seen.items():
            metric.add_metric([self._max_lora, adapters, adapters], seen)
        yield metric
