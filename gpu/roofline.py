"""Where a step sits on the roofline: its FLOPs and bytes, from the batch's shape alone.

The roofline says a step can go no faster than its bytes over the device's memory
bandwidth, nor than its FLOPs over the device's matmul throughput; whichever floor is
higher binds. Their ratio, the step's arithmetic intensity (FLOPs per byte), against
the device's ridge (peak FLOP/s over peak bytes/s) says which: decode at batch B does
about B FLOPs per byte of weights read (~2 FLOPs per weight per row, ~2 bytes per
bf16 weight), far below any ridge, so it is memory-bound; a prefill chunk of thousands
of tokens is far above it, so it is compute-bound; batching moves decode toward the
ridge.

The cost model, per step, for this decoder (every figure from the config and the
batch's query and context lengths; nothing is measured here):

- FLOPs = 2 · matmul_params · tokens          (q/k/v, o, gate/up, down of every layer:
                                                2 FLOPs per multiply-add)
        + 2 · vocab · hidden · logit_rows      (the LM head, only for rows that need
                                                logits: sampled rows, scored prompt rows)
        + 4 · heads · head_dim · layers · pairs (QKᵀ and PV: `pairs` counts each new
                                                query against each key it sees)
- bytes read = the layers' weights (once per step, whatever the batch)
             + the LM head (once, when any row needs logits)
             + the embedding rows of the step's tokens
             + KV read: Σ over sequences of the keys it sees × KV bytes per token
- bytes written = tokens × KV bytes per token (the new K and V)

Where a CPU reads a GGUF's quantized blocks for matmuls of few rows
(`gpu/cpu/linear.py`), those steps read the blocks' bytes instead (`blocks`).

Activations, norms and the sampler are left out: they are not the traffic a step
cannot avoid. So MBU (achieved bytes/s over peak) and MFU (achieved FLOP/s over peak)
computed from these figures are the utilisation of the compulsory work, the usual
definitions. A sliding window that is the same on every layer caps the keys a query
sees; per-layer windows (Qwen2's `max_window_layers`) are counted as full attention.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from operator import mul

from models.config import ModelConfig

log = logging.getLogger("ridgeline.runner")  # read beside the runner's memory plan


@dataclass(frozen=True)
class StepCost:
    """One step's work and how long the model thread took for it."""

    flops: int
    bytes_read: int
    bytes_written: int
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0


RAISED = "; raised to what a step achieved"  # `DevicePeaks.raised_to`


@dataclass(frozen=True)
class DevicePeaks:
    """What the device can do at best: copy bandwidth and matmul throughput."""

    bandwidth: float  # bytes/s a large device-to-device copy moves (read + write)
    flops: float  # FLOP/s of a large matmul in the served dtype
    device: str
    dtype: str
    how: str  # what was measured (or "given"), for the log and /plan

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOPs per byte) where the two roofs meet."""
        return self.flops / self.bandwidth

    def raised_to(self, bandwidth: float, flops: float) -> DevicePeaks:
        """These peaks, raised where a step achieved more: a copy measured on a busy host
        can come out low (or a step read from cache), and a utilisation of a peak must
        never pass 100 %."""
        if bandwidth <= self.bandwidth and flops <= self.flops:
            return self
        how = self.how if self.how.endswith(RAISED) else self.how + RAISED
        return replace(self, bandwidth=max(self.bandwidth, bandwidth),
                       flops=max(self.flops, flops), how=how)

    def floor_seconds(self, cost: StepCost) -> float:
        """The fastest the step could run: the higher of its two floors."""
        return max(cost.bytes / self.bandwidth, cost.flops / self.flops)

    def mbu(self, cost: StepCost) -> float:
        """Memory-bandwidth utilisation: achieved bytes/s over the peak."""
        return cost.bytes / cost.seconds / self.bandwidth if cost.seconds > 0 else 0.0

    def mfu(self, cost: StepCost) -> float:
        """Compute utilisation: achieved FLOP/s over the peak."""
        return cost.flops / cost.seconds / self.flops if cost.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"memory_bandwidth_gb_per_s": round(self.bandwidth / 1e9, 2),
                "matmul_tflop_per_s": round(self.flops / 1e12, 6),
                "ridge_flop_per_byte": round(self.ridge, 2), "device": self.device,
                "dtype": self.dtype, "how": self.how}


def flop_rate(flops_per_s: float) -> str:
    """'23.4 GFLOP/s' on a CPU, '989.0 TFLOP/s' on a GPU."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.1f} TFLOP/s"
    return f"{flops_per_s / 1e9:.1f} GFLOP/s"


def attention_work(query_lens: list[int], context_lens: list[int],
                   window: int | None = None) -> tuple[int, int]:
    """(query-key pairs, keys read) of a step's attention.

    A sequence that computes q new tokens ending at context length L runs queries at
    positions L-q .. L-1, which see L-q+1 .. L keys: q·L - q(q-1)/2 pairs; it reads its
    L keys once. A decode (q = 1) is L pairs and L keys. With a window W a query sees at
    most W keys, and the chunk reads at most W + q - 1 of them.
    """
    if window is None:
        pairs = sum(map(mul, query_lens, context_lens))
        pairs -= sum(q * (q - 1) // 2 for q in query_lens if q > 1)
        return pairs, sum(context_lens)
    pairs = keys = 0
    for q, end in zip(query_lens, context_lens):
        first = end - q + 1  # keys the first new query sees, before the window
        if end <= window:
            pairs += q * end - q * (q - 1) // 2
        elif first >= window:
            pairs += q * window
        else:  # the chunk crosses the window: a ramp up to W, then W each
            pairs += window * (window + 1) // 2 - first * (first - 1) // 2
            pairs += (end - window) * window
        keys += min(end, window + q - 1)
    return pairs, keys


@dataclass(frozen=True)
class QuantizedReads:
    """Bytes a step of few rows reads from quantized blocks instead of the served
    dtype's weights: the layers' matmuls up to `layer_max_rows` tokens, the LM head up
    to `head_max_rows` logit rows."""

    layer_bytes: int
    head_bytes: int
    layer_max_rows: int
    head_max_rows: int
    layer_params: int  # the matmul weights those blocks stand for


@dataclass(frozen=True)
class ModelCost:
    """The cost model above for one model in one dtype (see the module docstring)."""

    total_params: int
    matmul_params: int  # per token: every layer's q/k/v, o, gate/up and down weights
    layer_params: int  # every parameter but the embedding and the LM head
    head_params: int  # vocab × hidden (the tied embedding, or lm_head)
    hidden_size: int
    dtype_bytes: int
    kv_bytes_per_token: int
    attention_flops_per_pair: int  # 4 · heads · head_dim · layers
    window: int | None = None
    blocks: QuantizedReads | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype_bytes: int, window: int | None = None,
                    blocks: QuantizedReads | None = None,
                    kv_dtype_bytes: int | None = None) -> ModelCost:
        """`kv_dtype_bytes`: the KV cache's element size where it differs from the
        weights' (`--kv-cache-dtype`)."""
        hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        matmul = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
        extra = 2 * hidden  # the two RMSNorms
        if cfg.attention_bias:
            extra += q + 2 * kv
        if cfg.o_proj_bias:
            extra += hidden
        if cfg.mlp_bias:
            extra += 2 * inter + hidden
        if cfg.qk_norm:
            extra += 2 * hd
        layers = cfg.num_layers * (matmul + extra) + hidden  # + the final norm
        head = cfg.vocab_size * hidden
        return cls(
            total_params=layers + head * (1 if cfg.tie_word_embeddings else 2),
            matmul_params=cfg.num_layers * matmul,
            layer_params=layers,
            head_params=head,
            hidden_size=hidden,
            dtype_bytes=dtype_bytes,
            kv_bytes_per_token=cfg.kv_bytes_per_token(kv_dtype_bytes or dtype_bytes),
            attention_flops_per_pair=4 * cfg.num_heads * hd * cfg.num_layers,
            window=window,
            blocks=blocks,
        )

    @property
    def weights_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    def step(self, query_lens: list[int], context_lens: list[int], logit_rows: int,
             seconds: float = 0.0) -> StepCost:
        """The step's FLOPs and bytes (a few sums over the batch's lists)."""
        tokens = sum(query_lens)
        pairs, keys = attention_work(query_lens, context_lens, self.window)
        flops = (2 * self.matmul_params * tokens + 2 * self.head_params * logit_rows
                 + self.attention_flops_per_pair * pairs)
        layers, head = self.layer_params * self.dtype_bytes, self.head_params * self.dtype_bytes
        if self.blocks is not None and 0 < tokens <= self.blocks.layer_max_rows:
            layers += self.blocks.layer_bytes - self.blocks.layer_params * self.dtype_bytes
        if self.blocks is not None and 0 < logit_rows <= self.blocks.head_max_rows:
            head = self.blocks.head_bytes
        read = (layers + (head if logit_rows else 0) + tokens * self.hidden_size
                * self.dtype_bytes + keys * self.kv_bytes_per_token)
        return StepCost(flops, read, tokens * self.kv_bytes_per_token, seconds)

    def decode(self, batch: int, context: int) -> StepCost:
        """A decode step of `batch` sequences, each at `context` tokens after it."""
        return self.step([1] * batch, [context] * batch, batch)

    def prefill(self, tokens: int) -> StepCost:
        """One sequence's whole prompt of `tokens` in one step."""
        return self.step([tokens], [tokens], 1)


def log_roofline(peaks: DevicePeaks, cost: ModelCost, max_num_seqs: int, max_model_len: int
                 ) -> None:
    """Beside the memory plan: the device's roofs, and where decode will sit on them."""
    log.info("Device peaks: %.1f GB/s copy bandwidth, %s %s matmul; ridge at %.1f FLOP/byte "
             "(%s)", peaks.bandwidth / 1e9, flop_rate(peaks.flops), peaks.dtype, peaks.ridge,
             peaks.how)
    context = max_model_len // 2
    for batch in sorted({1, max_num_seqs}):
        step = cost.decode(batch, context)
        floor = peaks.floor_seconds(step)
        log.info("Roofline: decode at batch %d, context %d reads %.3f GiB and does %.1f FLOP/byte "
                 "(%s-bound): at best %.2f ms per step, %.0f tokens/s", batch, context,
                 step.bytes / (1 << 30), step.intensity,
                 "memory" if step.intensity < peaks.ridge else "compute", floor * 1e3,
                 batch / floor)
