"""Run once while the image is built: what every container's first start would otherwise do.

- Convert the embedded SmolLM2 GGUF into `RIDGELINE_CACHE_DIR`, in the dtype `--dtype auto`
  serves: bfloat16 in the CUDA image (no GPU is present while building, so it is not
  asked), the CPU's own choice in a CPU image. Another dtype converts at first start.
- In a CPU image, compile the C++ CPU kernels into `TORCH_EXTENSIONS_DIR`. They are built for
  the building machine's CPU; the library's name carries the CPU's model and flags, so on
  another CPU the first start builds its own instead of loading a wrong one.

Both land under /models, so a new volume mounted there starts with them.
"""

from __future__ import annotations

import logging

import torch

from models.resolve import resolve_model

logging.basicConfig(level=logging.INFO, format="%(message)s")

if torch.version.cuda:
    dtype = torch.bfloat16
else:
    from gpu.cpu.kernels.build import cpu_kernels
    from gpu.dtypes import cpu_auto_dtype

    dtype = cpu_auto_dtype()[0]
    if cpu_kernels() is None:
        raise SystemExit("the C++ CPU kernels did not build")
print(resolve_model(None, str(dtype).removeprefix("torch.")))
