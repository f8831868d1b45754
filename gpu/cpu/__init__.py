"""The CPU path of the model thread (`docs/cpu.md`).

`capabilities.py` resolves once what the CPU and the built C++ kernels can do;
`routing.py` decides which kernel multiplies each linear call from that and the
call's shape; `linear.py` holds the weights those routes need; `panel_blocks.py` the
GGUF blocks in the kernels' layout; `decoder_ops.py` the fused steps between matmuls;
`threads.py` fits torch's thread count to the cores the host leaves free;
`kernels/` the C++ sources and their build.
"""
