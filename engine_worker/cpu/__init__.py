"""CPU engine backend: a lean torch forward pass of Llama-family models (int4 weights,
batched decode), the embedded SmolLM2-135M-Instruct by default; transformers loads
the weights and the tokenizer.

Importing this package needs the ``cpu`` extra (torch, transformers, gguf,
accelerate, safetensors). ``CpuBackend`` implements ``engine_worker.backend.Backend``
and reads its options from ``engine_worker.settings.WorkerSettings`` (those
marked ``[cpu]`` and the shared ones).

| module | what |
|---|---|
| ``backend`` | ``CpuBackend``: loading, the ``Backend`` methods, each sequence's output pipeline |
| ``scheduler`` | the steps: prefill chunks, batched decode, n-gram drafts verified, the prefix cache fed |
| ``prompt`` | the chat template rendered and tokenized; the ids that end a sequence |
| ``vocab_tables`` | tables over the vocabulary: llguidance's, token bytes, XTC's and DRY's masks |
| ``sampling`` | one sequence's token selection: processors, filters, sampling, scores |
| ``ngram`` | n-gram prompt-lookup drafting |
| ``llama`` | the forward pass of Llama-family models over the quantized weights |
| ``quant`` | the weight formats (int4, int8, none), the int8 LM head, which kernel runs each product |
| ``kernels`` | the engine's own LLVM-generated kernels |
| ``kernel_choice`` | the kernels chosen at start by measured speed, kept per CPU |
| ``kv_cache`` | one sequence's KV cache |
| ``prefix_cache`` | the KV of earlier prompts, reused by later ones in blocks |
| ``model_store`` | the embedded GGUF converted once, and models loaded from folders |
| ``weight_cache`` | the quantized weights kept on disk between starts |
"""

from engine_worker.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
