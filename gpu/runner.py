"""The model runner: owns weights, the KV pool and the sampler; turns a Batch into tokens.

Runs on the model thread only (see gpu/worker.py). Everything here is tensors;
requests stay on the event loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionBackend, AttentionInputs, StepContext
from gpu.batch import Batch, StepResult
from gpu.memory import KVPlan, kv_bytes_per_token, plan_kv_cache
from gpu.sampler import Sampler
from models.config import LlamaConfig
from models.llama import LlamaForCausalLM
from models.weights import iter_safetensors

log = logging.getLogger("ridgeline.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerSpec:
    """What the model thread needs to build itself (plain values: crosses threads)."""

    model_dir: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    attention_backend: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    num_threads: int | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def make_backend(name: str, device: torch.device, cfg: LlamaConfig, block_size: int):
    args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from gpu.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(*args)
    from gpu.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(*args)


class ModelRunner:
    def __init__(self, spec: RunnerSpec):
        self.spec = spec
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.config = LlamaConfig.from_dir(spec.model_dir)
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config, max_positions=spec.max_model_len)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.rotary.__init__(self.config, spec.max_model_len)  # buffers are not on meta
        model.rotary.to(self.device)
        model.load_weights(iter_safetensors(spec.model_dir, self.dtype))
        weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.model = model.eval()
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            from gpu.cpu_linear import pack_linears

            pack_linears(self.model)
        log.info("Loaded %s (%s) in %.2f s", spec.model_dir, self.dtype, time.perf_counter() - t0)

        self.plan: KVPlan = plan_kv_cache(
            bytes_per_token=kv_bytes_per_token(
                self.config.num_layers, self.config.num_kv_heads, self.config.head_dim,
                torch.tensor([], dtype=self.dtype).element_size(),
            ),
            block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            weights_bytes=weights_bytes,
            kv_cache_memory=spec.kv_cache_memory,
            num_blocks=spec.num_blocks,
            total_device_bytes=self._total_device_bytes(),
            gpu_memory_utilization=spec.gpu_memory_utilization,
        )
        self.backend: AttentionBackend = make_backend(
            spec.attention_backend, self.device, self.config, spec.block_size
        )
        shape = self.backend.kv_cache_shape(self.plan.num_blocks)
        # Allocated once, never per request. Zeroed so stale NaNs can never leak through a mask.
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(self.config.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(self.config.num_layers)]
        self.sampler = Sampler(self.device, spec.seed)

    def _total_device_bytes(self) -> int | None:
        if self.device.type != "cuda" or self.spec.kv_cache_memory or self.spec.num_blocks:
            return None
        return torch.cuda.get_device_properties(self.device).total_memory

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepResult:
        t0 = time.perf_counter()
        dev = self.device
        qsl = list(itertools.accumulate(batch.query_lens, initial=0))
        width = max(len(t) for t in batch.block_tables)
        tables = [t + [0] * (width - len(t)) for t in batch.block_tables]
        inputs = AttentionInputs(
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(batch.context_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(batch.query_lens),
            max_context_len=max(batch.context_lens),
            query_lens_list=batch.query_lens,
            context_lens_list=batch.context_lens,
        )
        ctx = StepContext(self.backend, self.backend.prepare(inputs), self.k_caches, self.v_caches)
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, positions, ctx)
        tokens: list[int] = []
        logprobs: list = []
        if batch.sample_indices:
            last = torch.tensor([qsl[i + 1] - 1 for i in batch.sample_indices], device=dev)
            logits = self.model.compute_logits(hidden[last])
            tokens, logprobs = self.sampler(logits, batch.sampling)
        return StepResult(batch.step_id, tokens, logprobs, time.perf_counter() - t0)
