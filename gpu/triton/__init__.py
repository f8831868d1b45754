"""The Triton kernels of the CUDA path (`docs/gpu.md`), each beside its torch reference
(`reference.py`); tests run them under `TRITON_INTERPRET=1`."""
