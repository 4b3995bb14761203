"""CPU engine backend: a lean torch forward pass of Llama-family models (int4 weights,
batched decode), the embedded SmolLM2-135M-Instruct by default; transformers loads
the weights and the tokenizer.

Importing this package needs the ``cpu`` extra (torch, transformers, gguf,
accelerate, safetensors). ``CpuBackend`` implements ``engine_worker.backend.Backend``
and reads its options from ``engine_worker.settings.WorkerSettings`` (those
marked ``[cpu]`` and the shared ones).
"""

from engine_worker.cpu.engine import CpuBackend

__all__ = ["CpuBackend"]
