"""The model thread, on any device: everything that owns tensors.

`gpu/` is named for the design card's top level, not for the hardware: the same
worker, runner, sampler and memory plan run on CUDA and on CPU. Its rooms:

- top level: the worker (the thread), the runner (weights, KV pool, one step), the
  sampler, CUDA graphs, memory profiling and KV pool sizing, the roofline;
- `gpu/attention/`: the attention backends behind `base.py` (plain torch, the CPU
  path and the reference; Triton, on CUDA);
- `gpu/cpu/`: the CPU path: its capabilities, the routing of linear layers, the
  packed and quantized linears, the thread governor, and the C++ kernels
  (`gpu/cpu/kernels/`);
- `gpu/triton/`: the Triton kernels of the CUDA path, each with a torch reference.

Floors: the top level imports the rooms, `attention/` imports `cpu/` and `triton/`,
and `cpu/` and `triton/` import neither each other nor anything above them
(`tests/test_layout.py`).
"""
