"""The CPU engine's own kernels, generated at first use by LLVM for the host CPU
(AVX-512 VNNI); ``engine_worker.cpu.kernel_choice`` measures each against torch's
at start and ``engine_worker.cpu.llama`` runs the faster.

| module | what |
|---|---|
| ``jit`` | the LLVM and OpenMP plumbing: ``ready``, ``jit``, the IR every kernel shares |
| ``int4`` | the int4 linear layers' product: Q4_1 weights times int8 activations (``Product``) |
| ``int8_head`` | the LM head's int8 x int8 product (``Product``) |
| ``attention`` | decode attention over each sequence's own KV, a pass's rows in one call |
"""
