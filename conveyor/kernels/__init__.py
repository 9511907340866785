"""Small C kernels for the CPU, built per instruction-set tier and called through ctypes.

- ``isa.py`` reads the CPU's flags and picks the tier (generic, avx2, avx512, amx);
  ``CONVEYOR_CPU_ISA`` forces a lower one.
- ``build.py`` compiles a tier's library from ``csrc/`` with the system C compiler, once.
- ``bindings.py`` binds each kernel's float32 or bfloat16 entry point; ``library.py`` hands the
  model the kernels for its dtype, or None and one log line saying why.

The kernels (``csrc/<tier>/<kernel>.c``, the highest tier's file of a name wins):

- ``paged_decode``: attention of single-token queries read straight from the paged cache (no
  gathered copy, no padding to the batch's longest context).
- ``quant_linear``: a linear read from a GGUF's Q4_0/Q4_1/Q8_0 blocks, dequantized exactly as
  the loader does (the model dtype's weights, bit for bit), a third to a half of the bytes.
- ``rms_norm``: residual add + RMSNorm; ``glu``: act(gate) * up (SiLU or GELU); ``rope_kv``: rotary
  embedding and the K/V cache write; ``argmax``: greedy sampling's argmax; ``sample``: a draw
  under temperature, top_k, top_p and min_p without sorting the vocabulary.
- ``decode_stack.c``: every decoder layer of a step of single-token queries in one call, made
  of the kernels above, so such a step pays no per-op Python cost.

This package's ``__init__`` imports nothing: ``conveyor/__init__.py`` reads the tier before
torch is imported (see ``isa.cap_torch_dispatch``).
"""
