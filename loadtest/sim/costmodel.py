"""The simulator's step-time cost model and presets named for real deployments.

One engine step (a batch of chunked prefills plus one decode token per running sequence) takes

    step_s = step_overhead_s
           + prefill_token_s * prefill_tokens      (compute-bound prefill)
           + decode_seq_s    * decode_seqs         (per-sequence sampling/launch cost)
           + kv_read_token_s * context_tokens      (attention reads every scheduled sequence's KV)

The decode cost of reading the weights once per step is inside ``step_overhead_s``: at small batch
sizes decode is memory-bound on the weights, which is why the fixed term dominates there.

A real replica rarely runs small batches: other traffic (other clients of a shared replica, the
part of a fleet's load a replay does not model) keeps a decode batch in every step, and vLLM's
step with a large batch takes tens of ms. ``background_seqs`` sequences of
``background_context_tokens`` each model that: every step carries them (``busy`` builds such a
model), so a request's time to first token has a realistic fixed part -- the step in progress
and the step its prefill runs in -- and not only its prefill work.

The presets are APPROXIMATE. They are roofline estimates from public hardware and model figures,
rounded and cross-checked against the order of magnitude of public single-stream benchmarks:

* H100 SXM: 3.35 TB/s HBM3, ~1979 dense FP8 TFLOP/s (NVIDIA H100 datasheet).
  A100 80GB SXM: ~2.0 TB/s HBM2e, 312 dense BF16 TFLOP/s (NVIDIA A100 datasheet).
* Llama-3.1-8B: 32 layers, 8 KV heads x 128 dims -> 128 KiB of BF16 KV per token; ~8.5 GB of FP8
  weights. Weight read per step ~2.5 ms at 3.35 TB/s; with launch/sampling overhead, single-stream
  decode lands near the ~150-200 tokens/s that public vLLM runs of 8B FP8 on one H100 report,
  so ~6 ms per step. Prefill: 2 x 8e9 FLOP/token at ~35% of FP8 peak -> ~25k tokens/s.
* Llama-3-70B AWQ (4-bit weights, ~37 GB): 80 layers, 8 KV heads x 128 dims -> 320 KiB of KV per
  token. Weight read ~19 ms per step at 2 TB/s plus dequantisation overhead: public single-stream
  figures of ~25-35 tokens/s for 70B AWQ on one A100 -> ~30 ms per step. Prefill with 4-bit GEMM
  kernels runs well below the BF16 peak: ~2k tokens/s.
* KV read per context token = KV bytes per token / HBM bandwidth (0.04 us on H100 for 8B,
  0.16 us on A100 for 70B).
* KV capacity: (GPU memory x 0.9 - weights - activations) / KV bytes per token, in 16-token blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["PRESETS", "CostModel", "Preset", "get_preset"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per engine step as a linear function of what the step does."""

    step_overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    kv_read_token_s: float = 0.0
    background_seqs: int = 0  # other traffic decoding in every step
    background_context_tokens: int = 4096  # context of each of those sequences

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.step_overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * (decode_seqs + self.background_seqs)
            + self.kv_read_token_s
            * (context_tokens + self.background_seqs * self.background_context_tokens)
        )

    def slower(self, factor: float) -> CostModel:
        """Every step ``factor`` times as long: a slower GPU or kernel than its peers'."""
        return replace(self, step_overhead_s=self.step_overhead_s * factor,
                       prefill_token_s=self.prefill_token_s * factor,
                       decode_seq_s=self.decode_seq_s * factor,
                       kv_read_token_s=self.kv_read_token_s * factor)

    def busy(self, seqs: int = 192, context_tokens: int = 4096) -> CostModel:
        """This model on a replica that always decodes ``seqs`` other sequences (the default:
        a large batch, which makes h100-8b-fp8's step ~50 ms)."""
        return replace(self, background_seqs=seqs, background_context_tokens=context_tokens)


@dataclass(frozen=True, slots=True)
class Preset:
    """A named deployment: its cost model and the KV capacity vLLM would report for it."""

    name: str
    cost: CostModel
    num_gpu_blocks: int  # with block_size 16
    max_model_len: int
    description: str


PRESETS: tuple[Preset, ...] = (
    Preset(
        name="h100-8b-fp8",
        cost=CostModel(
            step_overhead_s=6.0e-3,
            prefill_token_s=40e-6,
            decode_seq_s=60e-6,
            kv_read_token_s=0.04e-6,
        ),
        # (80 GB x 0.9 - 8.5 GB weights - ~3 GB activations) / 128 KiB per token ~ 460k tokens
        num_gpu_blocks=28_000,
        max_model_len=32_768,
        description="Llama-3.1-8B in FP8 on one H100 80GB (approximate)",
    ),
    Preset(
        name="a100-70b-awq",
        cost=CostModel(
            step_overhead_s=30e-3,
            prefill_token_s=500e-6,
            decode_seq_s=250e-6,
            kv_read_token_s=0.16e-6,
        ),
        # (80 GB x 0.9 - 37 GB weights - ~3 GB activations) / 320 KiB per token ~ 100k tokens
        num_gpu_blocks=6_200,
        max_model_len=16_384,
        description="Llama-3-70B AWQ 4-bit on one A100 80GB (approximate)",
    ),
)


def get_preset(name: str) -> Preset:
    for preset in PRESETS:
        if preset.name == name:
            return preset
    names = ", ".join(p.name for p in PRESETS)
    raise ValueError(f"unknown preset {name!r} (known: {names})")
