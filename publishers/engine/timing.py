"""How long a simulated engine takes to prefill, load cached KV and decode.

Defaults describe LLaMA3-70B on one 8×A800 node as in Mooncake (FAST'25), Table 1 and
Eq. 1: prefill of ``n`` new tokens after a cached prefix of ``p`` costs
``l·(a·(N² − p²)·d + b·(N − p)·d²)`` FLOPs with ``N = n + p`` (Eq. 1 minus the reused
prefix), KV takes ``l·2·(d/gqa)·s`` bytes per token and is loaded at
``B = min(B_h2d, B_nic)``.

Constants and units (decimal GB, as the paper): ``l = 80``, ``d = 8192``, ``a = 4``,
``b = 22``, ``gqa = 8``, ``s = 2`` B (BF16) → 327,680 B = 320 KiB of KV per token;
``G = 8 × 312e12`` FLOP/s (BF16 dense A800); ``B_h2d = 128 GB/s`` and
``B_nic = 800 Gbit/s = 100 GB/s``, so ``B = 100e9`` B/s.

MFU: the paper's analysis uses peak ``G``. Its Figure 14a (layer-wise prefill, no prefix
cache, bar heights read from the PDF's vector data) shows ≈ 1.0 s for 8k tokens, 2.1 s for
16k, 4.5 s for 32k, 10.6 s for 64k and 27.5 s for 128k. Against Eq. 1 at peak that is an
effective MFU of 0.46 at 8k rising to 0.88 at 128k (Eq. 1 counts full, not causal,
attention). The default ``mfu = 0.5`` with a 20 ms overhead fits the 8k–16k range most
requests fall in: 1k → 0.119 s, 8k → 0.936 s, 16k → 2.13 s, 32k → 5.38 s (paper 4.5 s);
very long prompts come out slower than the paper's.

Decode is memory-bound: each step reads the weights and every running sequence's KV from
HBM (8 × 2.039 TB/s on A800-80GB at ``mbu`` utilization) and computes Eq. 1's increment per
sequence; both terms are added (no overlap), which keeps the model monotone in batch size
and context. Defaults give ≈ 25 ms per step for one 8k-token sequence — the paper's Figure
14b shows ≈ 27 ms per token at 8k (128 tokens in ≈ 3.4 s).

Every constant is a field so the same model can describe a smaller engine. Results are model
seconds; the engine loop's ``--sim-time-scale`` maps them to wall time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def _constant(default: float, meaning: str) -> Any:
    """A field whose ``meaning`` is also its command-line help (``--sim-*`` flags)."""
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True, slots=True)
class TimingModel:
    num_layers: int = _constant(80, "transformer layers (l)")
    hidden_size: int = _constant(8192, "hidden size (d)")
    attention_coef: float = _constant(4.0, "attention FLOPs coefficient (a)")
    linear_coef: float = _constant(22.0, "linear-layer FLOPs coefficient (b)")
    gqa: int = _constant(8, "query heads per KV head")
    element_bytes: int = _constant(2, "bytes per KV element (s; 2: BF16)")
    gpu_flops: float = _constant(8 * 312e12, "FLOP/s of the whole instance (G)")
    mfu: float = _constant(0.5, "achieved fraction of G when prefilling")
    prefill_overhead_s: float = _constant(0.020, "scheduling, launch and sampling per prefill")
    h2d_bandwidth: float = _constant(128e9, "host-to-device bytes/s (B_h2d)")
    nic_bandwidth: float = _constant(100e9, "network bytes/s (B_nic: 800 Gbit/s)")
    hbm_bandwidth: float = _constant(8 * 2.039e12, "HBM bytes/s of the whole instance")
    mbu: float = _constant(0.6, "achieved fraction of HBM bandwidth when decoding")
    weight_bytes: float = _constant(141e9, "bytes of weights (70.6e9 parameters in BF16)")
    decode_overhead_s: float = _constant(
        0.010, "launch, all-reduce latency and sampling per decode step"
    )

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * 2 * (self.hidden_size / self.gqa) * self.element_bytes

    @property
    def kv_load_bandwidth(self) -> float:
        """B: cached KV crosses both the NIC and the host-to-device link."""
        return min(self.h2d_bandwidth, self.nic_bandwidth)

    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Eq. 1 for the whole prompt minus Eq. 1's share of the reused prefix."""
        total = new_tokens + cached_tokens
        d = self.hidden_size
        attention = self.attention_coef * (total * total - cached_tokens * cached_tokens) * d
        linear = self.linear_coef * new_tokens * d * d
        return self.num_layers * (attention + linear)

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to compute ``new_tokens`` after ``cached_tokens`` already in HBM; 0 if none."""
        if new_tokens <= 0:
            return 0.0
        return self.prefill_overhead_s + self._prefill_compute_seconds(new_tokens, cached_tokens)

    def step_seconds(
        self,
        prefills: Sequence[tuple[int, int]],
        loaded_tokens: int = 0,
        num_decodes: int = 0,
        decode_context: int = 0,
    ) -> float:
        """One engine step (one forward pass): prefill chunks given as ``(new tokens, tokens
        before them)``, KV loads and a decode batch holding ``decode_context`` tokens of KV.

        Each chunk costs its own share of Eq. 1, so a prompt split into chunks costs what it
        would in one piece, plus one prefill overhead per step that computes any prompt.
        """
        chunks = [(new, before) for new, before in prefills if new > 0]
        prefill = sum(self._prefill_compute_seconds(new, before) for new, before in chunks)
        overhead = self.prefill_overhead_s if chunks else 0.0
        load = self.kv_load_seconds(loaded_tokens)
        return overhead + prefill + load + self.decode_step_seconds(num_decodes, decode_context)

    def _prefill_compute_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        return self.prefill_flops(new_tokens, cached_tokens) / (self.gpu_flops * self.mfu)

    def kv_load_seconds(self, tokens: int) -> float:
        """Time to bring ``tokens`` of cached KV into HBM (CPU tier or remote store)."""
        return tokens * self.kv_bytes_per_token / self.kv_load_bandwidth

    def decode_step_seconds(self, batch_size: int, context_tokens: int) -> float:
        """One decode step for ``batch_size`` sequences holding ``context_tokens`` KV in all.

        FLOPs per sequence are Eq. 1's increment for one more token,
        ``l·(a·(2c + 1)·d + b·d²)``, summed over the batch.
        """
        if batch_size <= 0:
            return 0.0
        d = self.hidden_size
        memory_bytes = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        memory = memory_bytes / (self.hbm_bandwidth * self.mbu)
        flops = self.num_layers * (
            self.attention_coef * (2 * context_tokens + batch_size) * d
            + batch_size * self.linear_coef * d * d
        )
        compute = flops / (self.gpu_flops * self.mfu)
        return self.decode_overhead_s + memory + compute
