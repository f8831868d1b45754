"""The model runner: owns weights, the KV pool and the sampler; turns a Batch into tokens.

Runs on the model thread only (see gpu/worker.py). Everything here is tensors;
requests stay on the event loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from gpu.attention.base import AttentionBackend, StepContext
from gpu.batch import Batch, SamplingRow, StepResult
from gpu.block_table import DeviceBlockTable
from gpu.cpu.capabilities import CpuCapabilities, describe
from gpu.cpu.capabilities import resolve as resolve_cpu_capabilities
from gpu.cpu.threads import ThreadGovernor
from gpu.draft import DraftModel
from gpu.dtypes import resolve_device, resolve_dtype, resolve_kv_dtype
from gpu.lora import LoRASlots
from gpu.lora_rows import row_kernel
from gpu.memory import KVPlan, check_host_memory, kv_bytes_per_token, plan_kv_cache, zeroed_pool
from gpu.peaks import measure_peaks
from gpu.profiling import MemoryProfile, profile_memory
from gpu.roofline import DevicePeaks, ModelCost, log_roofline
from gpu.sampler import Sampler
from gpu.staging import Staging
from gpu.step_inputs import apply_table_updates, stage_eager_step
from models import gguf_blocks
from models.config import ModelConfig
from models.decoder import DecoderForCausalLM
from models.ops import DecoderOps
from models.weights import iter_safetensors

if TYPE_CHECKING:
    from gpu.graphs import GraphRunner

log = logging.getLogger("ridgeline.runner")

@dataclass(frozen=True)
class RunnerSpec:
    """What the model thread needs to build itself (plain values: crosses threads).

    Every value the engine passes comes from its config (`app/config.py` is the one
    home of settings), picked by field name with `from_config`. The last three CPU
    options have defaults only so that a spec built by hand (a test, a script) may leave
    them out; `from_config` always sets them.
    """

    model_dir: str
    dtype: str
    device: str
    max_model_len: int  # resolved against the model's context before the spec is built
    block_size: int
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    num_blocks: int | None
    attention_backend: str
    seed: int
    enforce_eager: bool
    # The scheduler's caps: they size the profiling step and the CUDA-graph buckets.
    max_num_seqs: int
    max_num_batched_tokens: int
    torch_threads: int | None  # None: torch's default
    cpu_quantized_matmul: bool = True  # a GGUF's blocks for few-row fp32 matmuls on CPU
    int8_activations: bool | None = False  # every call int8 x; None: where it can (dtypes.py)
    int8_batches: bool = False  # many rows' calls so, without AMX (`gpu/cpu/routing.py`)
    kv_cache_dtype: str = "auto"  # "bfloat16": a float32 model's KV cache in half the bytes
    draft_model_dir: str | None = None  # speculative decoding's draft model (gpu/draft.py)
    draft_window: int | None = None  # its window of tokens (None: max_model_len)
    fit_max_model_len: bool = False  # none asked for: the pool may lower it (`plan_kv_cache`)
    # Speculative decoding's verify steps (`gpu/verify_graphs.py`): drafts per row (0: none),
    # and the running requests from which nobody drafts.
    num_speculative_tokens: int = 0
    disable_by_batch_size: int | None = None
    enable_lora: bool = False  # LoRA adapters per request (`gpu/lora.py`)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    @classmethod
    def from_config(cls, flat: Mapping[str, Any], **overrides: Any) -> RunnerSpec:
        """Take this spec's fields by name from the engine's flat settings
        (`EngineConfig.flat()`), then `overrides` (the resolved model directory)."""
        values = {f.name: flat[f.name] for f in fields(cls) if f.name in flat}
        return cls(**(values | overrides))


def cpu_capabilities(backend_name: str, device: torch.device,
                     int8_batches: bool = False) -> CpuCapabilities | None:
    """What the CPU and its C++ kernels can do, resolved once at load (None off CPU); the
    kernels are loaded for the `auto` attention backend (`torch`: plain torch)."""
    if device.type == "cpu":
        return resolve_cpu_capabilities(backend_name == "auto", int8_batches)


def make_backend(name: str, device: torch.device, cfg: ModelConfig, block_size: int,
                 capabilities: CpuCapabilities | None = None):
    """The attention backend; on CPU it takes `capabilities` (resolved here if not given)."""
    args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from gpu.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(*args)
    from gpu.attention.torch_backend import TorchAttentionBackend

    if name != "auto" or device.type != "cpu":  # "torch" keeps plain torch, the reference
        return TorchAttentionBackend(*args)
    return TorchAttentionBackend(*args, kernels=capabilities or cpu_capabilities(name, device))


def decoder_ops(backend: AttentionBackend,
                capabilities: CpuCapabilities | None = None) -> DecoderOps:
    """Fused kernels for the steps between matmuls: Triton where attention runs on
    Triton (which fuses RoPE into its KV store too), C++ on CPU where those kernels are
    built (`attention_backend` auto); plain torch otherwise."""
    if capabilities is not None and capabilities.has("add_rms_norm_"):
        from gpu.cpu.decoder_ops import CpuDecoderOps

        return CpuDecoderOps(capabilities)
    if backend.fuses_rotary:
        from gpu.triton.decoder_ops import TritonDecoderOps

        return TritonDecoderOps()
    return DecoderOps()


# Prompt positions scored at once: bounds the [rows, vocab] float32 logits of a long prompt.
SCORE_CHUNK = 128


def score_tokens(compute_logits, hidden: torch.Tensor, targets: list[int],
                 top_k: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """log p(target_j | prefix) for each row j of `hidden`, its rank, and the top k."""
    out = []
    for lo in range(0, len(targets), SCORE_CHUNK):
        rows = torch.log_softmax(compute_logits(hidden[lo:lo + SCORE_CHUNK]), dim=-1)
        tgt = torch.tensor(targets[lo:lo + SCORE_CHUNK], device=rows.device)
        chosen = rows.gather(1, tgt[:, None])[:, 0]
        ranks = (rows > chosen[:, None]).sum(dim=-1) + 1
        top = rows.topk(top_k, dim=-1) if top_k else None
        for j, (lp, rank) in enumerate(zip(chosen.tolist(), ranks.tolist())):
            pairs = (list(zip(top.indices[j].tolist(), top.values[j].tolist()))
                     if top is not None else [])
            out.append((lp, rank, pairs))
    return out


class ModelRunner:
    def __init__(self, spec: RunnerSpec, weights: Iterable[tuple[str, torch.Tensor]] | None = None):
        """`weights` (HF names) replace the checkpoint's tensors; the GPU check uses it
        to build a random model of a real shape without writing it to disk."""
        self.spec = spec
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(spec.kv_cache_dtype, self.dtype, self.device)
        self.config = ModelConfig.from_dir(spec.model_dir)
        # CPU threads: a fixed number when asked, else fitted to what the host leaves free.
        self.governor: ThreadGovernor | None = None
        if self.device.type == "cpu" and spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        elif self.device.type == "cpu":
            self.governor = ThreadGovernor.for_this_host()
        log.info("torch uses %d CPU threads%s", torch.get_num_threads(),
                 " (adjusted to the cores the host leaves free)" if self.governor else "")
        # Before anything of ours is allocated: what other processes (and the context) hold.
        self._free_at_start = (torch.cuda.mem_get_info(self.device)[0]
                               if self.device.type == "cuda" else None)
        # Resolved once; the backend, the decoder ops and the linears ask it.
        self.capabilities = cpu_capabilities(spec.attention_backend, self.device, spec.int8_batches)
        if self.capabilities is not None:
            log.info("CPU capabilities: %s", describe(self.capabilities))
        self.backend: AttentionBackend = make_backend(
            spec.attention_backend, self.device, self.config, spec.block_size,
            self.capabilities)
        t0 = time.perf_counter()
        block_reads = None  # what few-row steps read from a GGUF's blocks instead
        with torch.device("meta"):
            model = DecoderForCausalLM(self.config, max_positions=spec.max_model_len,
                                       ops=decoder_ops(self.backend, self.capabilities))
        # Allocate (lazily) in the serving dtype: never fp32 first. (Not `.to(dtype)
        # .to_empty()`: on meta tensors that imports sympy, slow to start.)
        model._apply(lambda t: torch.empty(
            t.shape, device=self.device,
            dtype=self.dtype if t.is_floating_point() else t.dtype))
        model.rotary = model.make_rotary(spec.max_model_len).to(self.device)  # not on meta
        weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.device.type == "cpu" and weights is None:  # before any weight is read
            check_host_memory(spec.model_dir, weights_bytes, spec.kv_cache_memory)
        self.model = model.eval()
        matmul_dtype = self.dtype  # what the linears multiply in (peaks, roofline)
        int8 = False  # int8 activations in every call (`--int8-activations`)
        if self.capabilities is not None:
            from gpu.cpu import linear as cpu_linear
            from gpu.cpu import packing

            matmul_dtype = cpu_linear.multiply_dtype(self.dtype)
            # A GGUF's layers hold their blocks alone (read from the file as each layer
            # is built), every call reading them (`gpu/cpu/routing.py`);
            # `--no-cpu-quantized-matmul` serves them dense.
            gguf = {} if weights is not None else gguf_blocks.load(
                spec.model_dir, repack=self.capabilities.op("gguf_repack"))
            blocks = gguf if spec.cpu_quantized_matmul and matmul_dtype in (
                torch.float32, torch.bfloat16) else {}
            kernels = self.capabilities
            why = packing.int8_unavailable(self.dtype, blocks, kernels)
            if spec.int8_activations and why:
                raise ValueError(f"--int8-activations cannot run: {why}")
            int8 = spec.int8_activations is not False and why is None  # None: where it can
            # The parameters the layers will not read (served from their blocks alone, or
            # widened from the checkpoint's float32): never filled, never dequantized.
            skip = packing.params_not_needed(model, blocks, kernels, int8)
            # By name, for `pack_linears`: views of the mapped files, no copies.
            checkpoint = dict(weights if weights is not None else iter_safetensors(
                spec.model_dir, placeholders=model.checkpoint_names(skip), blocks=gguf))
            model.load_weights(checkpoint.items(), skip=skip)
            # What its packed copies and the blocks add in host memory (negative where a
            # layer holds its blocks alone): the plan logs the weights as they lie there.
            weights_bytes += packing.pack_linears(self.model, blocks, kernels, int8, checkpoint)
            block_reads = packing.quantized_reads(self.model)
        elif spec.int8_activations:
            raise ValueError(f"--int8-activations is for CPU: this model runs on {self.device}")
        else:
            checkpoint = weights if weights is not None else iter_safetensors(spec.model_dir)
            model.load_weights(checkpoint)
        del checkpoint  # the mapped files
        log.info("Loaded %s (%s) in %.2f s", spec.model_dir, self.dtype, time.perf_counter() - t0)
        self.loras = self._lora_slots()
        self.graph_sizes = self._graph_sizes()  # decode buckets to capture; [] when eager
        # Before the profile and the pool: on CUDA the measurement's buffers must fit.
        self.peaks: DevicePeaks = measure_peaks(
            self.device, matmul_dtype, weights_bytes,
            int8_kernels=self.capabilities.kernels if int8 else None)
        self.draft = DraftModel(spec.draft_model_dir, self.dtype, self.device,
                                spec.max_model_len) if spec.draft_model_dir else None
        self.profile = self._profile()  # runs the draft model's largest call too
        dtype_bytes = torch.tensor([], dtype=matmul_dtype).element_size()
        kv_dtype_bytes = torch.tensor([], dtype=self.kv_dtype).element_size()
        self.plan: KVPlan = plan_kv_cache(
            bytes_per_token=kv_bytes_per_token(
                self.config.num_layers, self.config.num_kv_heads, self.config.head_dim,
                kv_dtype_bytes),
            block_size=spec.block_size,
            max_model_len=spec.max_model_len, fit_max_model_len=spec.fit_max_model_len,
            # Sized from the GPU's memory, the pool leaves room for the LoRA slots too.
            weights_bytes=weights_bytes + (self.loras.nbytes if self.loras is not None
                                           and self._auto_sized() else 0),
            draft_bytes=self.draft.nbytes if self.draft is not None else 0,
            kv_cache_memory=spec.kv_cache_memory,
            num_blocks=spec.num_blocks,
            total_device_bytes=self._total_device_bytes(),
            free_device_bytes=self._free_at_start,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            peak_activation_bytes=self.profile.peak_activation_bytes,
            graph_bytes=self.profile.graph_bytes,
            sliding_window=self.config.uniform_window,
        )
        self.cost = ModelCost.from_config(self.config, dtype_bytes, self.plan.sliding_window,
                                          block_reads, kv_dtype_bytes)
        log_roofline(self.peaks, self.cost, spec.max_num_seqs, self.plan.max_model_len)
        shape = self.backend.kv_cache_shape(self.plan.num_blocks)
        if self.kv_dtype != self.dtype:
            log.info("KV cache dtype: %s under %s weights (--kv-cache-dtype): half the bytes "
                     "per token, attention computes in float32",
                     str(self.kv_dtype).removeprefix("torch."),
                     str(self.dtype).removeprefix("torch."))
        # Allocated once, never per request.
        self.k_caches = [zeroed_pool(shape, self.kv_dtype, self.device)
                         for _ in range(self.config.num_layers)]
        self.v_caches = [zeroed_pool(shape, self.kv_dtype, self.device)
                         for _ in range(self.config.num_layers)]
        self.sampler = Sampler(self.device, spec.seed, self.capabilities)
        # The engine's block tables, one persistent row per scheduled request.
        max_blocks = -(-spec.max_model_len // spec.block_size)
        self.tables = DeviceBlockTable(spec.max_num_seqs, max_blocks, self.device)
        self.staging = Staging(self.device)
        self.graphs = self._capture_graphs()

    def _lora_slots(self) -> LoRASlots | None:
        spec = self.spec
        if not spec.enable_lora:
            return None
        cpu_kernel = self.capabilities.op("lora_delta_") if self.capabilities else None
        return LoRASlots(self.model, spec.max_loras, spec.max_lora_rank,
                         spec.max_cpu_loras or spec.max_loras, self.dtype, self.device,
                         kernel=row_kernel(self.device), cpu_kernel=cpu_kernel)

    def _auto_sized(self) -> bool:
        """True when the pool takes what the GPU has left (no explicit size given)."""
        spec = self.spec
        return self.device.type == "cuda" and not (spec.kv_cache_memory or spec.num_blocks)

    def _total_device_bytes(self) -> int | None:
        return (torch.cuda.get_device_properties(self.device).total_memory
                if self._auto_sized() else None)

    def _graph_sizes(self) -> list[int]:
        if self.device.type != "cuda" or self.spec.enforce_eager:
            return []
        from gpu.attention.triton_backend import TritonAttentionBackend
        from gpu.graphs import graph_sizes

        if not isinstance(self.backend, TritonAttentionBackend):
            log.info("CUDA graphs are off: %s steps cannot be captured",
                     type(self.backend).__name__)
            return []
        return graph_sizes(self.spec.max_num_seqs)

    def _profile(self) -> MemoryProfile:
        if not self._auto_sized():
            return MemoryProfile(0, 0)
        spec, sizes = self.spec, self.graph_sizes
        if sizes and spec.num_speculative_tokens:  # verify steps' graphs too
            from gpu.verify_graphs import graph_token_counts, verify_sizes

            sizes = graph_token_counts(sizes, verify_sizes(
                spec.max_num_seqs, spec.disable_by_batch_size), spec.num_speculative_tokens + 1)
        k = max(spec.num_speculative_tokens, 1)  # a window then k guesses, within the context
        draft_call = None if self.draft is None else self.draft.largest_call(
            min(spec.draft_window or spec.max_model_len, spec.max_model_len - k), k)
        return profile_memory(
            self.model, self.backend, device=self.device, dtype=self.dtype,
            max_num_batched_tokens=spec.max_num_batched_tokens, max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len, graph_sizes=sizes, draft_call=draft_call)

    def _capture_graphs(self) -> GraphRunner | None:
        """A GraphRunner with every bucket captured, or None (CPU, --enforce-eager)."""
        if not self.graph_sizes:
            return None
        from gpu.graphs import GraphRunner

        spec = self.spec
        graphs = GraphRunner(self.model, self.backend, self.k_caches, self.v_caches,
                             sizes=self.graph_sizes, max_model_len=spec.max_model_len,
                             tables=self.tables, loras=self.loras)
        if spec.num_speculative_tokens:
            from gpu.verify_graphs import VerifyGraphs, verify_sizes

            graphs.verify = VerifyGraphs(graphs, verify_sizes(
                spec.max_num_seqs, spec.disable_by_batch_size), spec.num_speculative_tokens + 1)
        graphs.capture()
        return graphs

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepResult:
        """Run the step; the result carries its cost (FLOPs, bytes) and its time."""
        t0 = time.perf_counter()
        result = self._execute(batch)
        if self.device.type == "cuda":  # a step without sampled rows has not synced yet
            torch.cuda.synchronize(self.device)
        rows = len(batch.sampling) + sum(len(p.targets) for p in batch.prompt_logprobs)
        result.cost = self.cost.step(batch.query_lens, batch.context_lens, rows,
                                     time.perf_counter() - t0)
        if self.governor is not None:
            self.governor.step_done()
        return result

    def _execute(self, batch: Batch) -> StepResult:
        """Forward, logits for the rows that sample, sampling. The host waits on the
        device once per step, when the sampled tokens come back (`gpu/staging.py`)."""
        if self.governor is not None:
            self.governor.tick()
        # 1. The forward: a CUDA-graph replay for a decode or verify step that fits a bucket.
        if self.graphs is not None and self.graphs.can_run(batch):
            apply_table_updates(batch, self.staging, self.tables)
            hidden = self.graphs.run(batch)  # per sequence; a verify step's: per logit row
            rows = None if batch.samples_every_row or not batch.is_decode_only else \
                self.staging.stage((batch.sample_indices, torch.long))[0]
        else:
            inputs = stage_eager_step(batch, self.staging, self.tables, self.spec.block_size)
            ctx = StepContext(self.backend, self.backend.prepare(inputs.attention),
                              self.k_caches, self.v_caches)
            if self.loras is None or not batch.lora_ids:
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)
            else:
                with self.loras.step(batch.lora_ids, batch.query_lens, self.device):
                    hidden = self.model(inputs.input_ids, inputs.positions, ctx)
            rows = inputs.logit_rows
        result = StepResult([], [])
        if batch.sample_indices:
            # 2. Logits, only for the rows that sample (the last new token of each, or
            # every position a speculating sequence's drafts are verified at).
            logits = self.model.compute_logits(hidden if rows is None else hidden[rows],
                                               widen=False)
            # 3. Sampling; its results are the step's one device-to-host copy.
            result = self._sample(logits, batch.sampling)
        # 4. Prompt logprobs (echo, prompt_logprobs): every position of those chunks.
        if batch.prompt_logprobs:
            starts = list(itertools.accumulate(batch.query_lens, initial=0))
            for want in batch.prompt_logprobs:
                start = starts[want.seq_index]
                result.prompt_logprobs[want.seq_index] = score_tokens(
                    self.model.compute_logits, hidden[start:start + len(want.targets)],
                    want.targets, want.top_k)
        return result

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> StepResult:
        """Sample every row at once; if that fails, row by row, so that a row that fails
        on its own fails only its request."""
        try:
            return StepResult(*self.sampler(logits, rows))
        except Exception:
            pass
        result = StepResult([], [])
        for i, row in enumerate(rows):
            try:
                (token,), (lp,) = self.sampler(logits[i : i + 1], [row])
            except Exception as e:
                log.exception("sampling failed for one row; its request fails")
                token, lp, result.failed[i] = -1, None, f"sampling failed: {e!r}"
            result.token_ids.append(token)
            result.logprobs.append(lp)
        return result

