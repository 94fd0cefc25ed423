"""The engine simulator's timing model."""

from __future__ import annotations

import dataclasses

import pytest

from publishers.engine.timing import TimingModel

MODEL = TimingModel()


def test_table_1_constants() -> None:
    """KV per token l·2·(d/gqa)·s = 320 KiB; B = min(128 GB/s, 800 Gbit/s) = 100 GB/s."""
    assert MODEL.kv_bytes_per_token == 320 * 1024 == 327_680
    assert MODEL.kv_load_bandwidth == 100e9
    assert MODEL.gpu_flops == 8 * 312e12


def test_equation_2_threshold() -> None:
    """The paper: for an 8k prefix on 8×A800, reuse pays off above B ≈ 6 GB/s."""
    d, p = MODEL.hidden_size, 8192
    per_layer = MODEL.attention_coef * p * d + MODEL.linear_coef * d * d
    minimum_bandwidth = MODEL.gpu_flops * 2 * d * MODEL.element_bytes / (MODEL.gqa * per_layer)
    assert minimum_bandwidth == pytest.approx(6e9, rel=0.05)


@pytest.mark.parametrize(
    ("tokens", "seconds"), [(1024, 0.1191), (8192, 0.9363), (16384, 2.1344), (32768, 5.3766)]
)
def test_reference_prefill_times(tokens: int, seconds: float) -> None:
    """The numbers documented in the module (MFU 0.5, 20 ms overhead)."""
    assert MODEL.prefill_seconds(tokens) == pytest.approx(seconds, rel=1e-3)


def test_8k_prefill_matches_the_paper() -> None:
    """Figure 14a: ≈ 1.0 s for an 8k-token prefill without prefix cache."""
    assert MODEL.prefill_seconds(8192) == pytest.approx(1.0, rel=0.1)


def test_kv_load_times() -> None:
    assert MODEL.kv_load_seconds(8192) == pytest.approx(8192 * 327_680 / 100e9)
    assert MODEL.kv_load_seconds(8192) == pytest.approx(0.0268, rel=1e-2)
    assert MODEL.kv_load_seconds(0) == 0.0


def test_prefix_cache_saves_more_than_loading_costs() -> None:
    cold = MODEL.prefill_seconds(8192)
    warm = MODEL.prefill_seconds(410, 7782) + MODEL.kv_load_seconds(7782)
    assert warm < cold / 5


def test_prefill_monotone() -> None:
    assert MODEL.prefill_seconds(0, 5000) == 0.0
    times = [MODEL.prefill_seconds(n) for n in (1, 100, 1000, 10_000, 100_000)]
    assert times == sorted(times) and len(set(times)) == len(times)
    # the same prompt, more of it cached: faster
    total = 16_384
    cached = [MODEL.prefill_seconds(total - p, p) for p in (0, 4096, 8192, 16_000)]
    assert cached == sorted(cached, reverse=True)
    # the same new tokens after a longer prefix: slower (attention over the prefix)
    after = [MODEL.prefill_seconds(1024, p) for p in (0, 8192, 65_536)]
    assert after == sorted(after)


def test_decode_grows_with_batch_and_context() -> None:
    by_batch = [MODEL.decode_step_seconds(b, 4096 * b) for b in (1, 8, 32, 128)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == 4
    same_context = [MODEL.decode_step_seconds(b, 65_536) for b in (1, 16, 64)]
    assert same_context == sorted(same_context) and len(set(same_context)) == 3
    by_context = [MODEL.decode_step_seconds(16, c) for c in (0, 10_000, 1_000_000)]
    assert by_context == sorted(by_context) and len(set(by_context)) == 3
    assert MODEL.decode_step_seconds(0, 0) == 0.0


def test_decode_step_matches_the_paper() -> None:
    """Figure 14b: 128 tokens in ≈ 3.4 s at 8k context, ≈ 27 ms per step."""
    assert MODEL.decode_step_seconds(1, 8192) == pytest.approx(0.027, rel=0.15)


def test_overridable() -> None:
    small = TimingModel(num_layers=32, hidden_size=4096, gpu_flops=312e12, weight_bytes=16e9)
    assert small.kv_bytes_per_token == 32 * 2 * 512 * 2
    assert small.prefill_seconds(8192) < MODEL.prefill_seconds(8192)
    with pytest.raises(dataclasses.FrozenInstanceError):
        MODEL.mfu = 1.0  # type: ignore[misc]
