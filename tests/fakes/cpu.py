"""Fakes of the CPU engine's model side (``engine_worker.cpu``).

- ``tiny_random_llama``: a small Llama with random weights over a real tokenizer, for
  tests of engine mechanics (milliseconds per step).
- ``ScriptedLlama`` / ``ScriptedRunner``: that model with a "bigram script": at every
  position whose input token has a scripted successor, that successor gets
  ``SCRIPT_BOOST`` on the logits, so the generated tokens are known in advance,
  identical however the sequence is chunked, cached, drafted or batched. The script
  lives on the model object; ``ScriptedRunner`` (the engine's forward pass with the
  script applied) reads it at every pass.
- ``FakeModel`` / ``FakeTokenizer``: what ``transformers`` loads from a GGUF, as far as
  ``model_store``'s conversion uses it.
- ``add``: what the worker loop does for one request before the backend starts it.
- ``load_tokenizer_embedded``: the embedded model's real tokenizer, without its weights.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from engine_worker.admission import checked_prepare
from engine_worker.cpu import model_store
from engine_worker.cpu.backend import CpuBackend
from engine_worker.cpu.llama import LlamaRunner
from engine_worker.cpu.model_store import LoadedModel
from engine_worker.cpu.quant import Quantization
from protocol.messages import Submit


def add(backend: CpuBackend, submit: Submit) -> None:
    """Validate, prepare, budget (``admission.checked_prepare``) and start one sequence
    under ``submit.request_id``, as the loop would. Raises ``RequestRejected``."""
    backend.start(submit.request_id, checked_prepare(backend, submit), submit.params)


def tiny_random_llama(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_position_embeddings: int = 8192,
    model_id: str = "tiny-random-llama",
) -> LoadedModel:
    """A small Llama with random weights over ``tokenizer``'s vocabulary, for tests
    of engine mechanics (shapes, caches, counters) that need real tensors but not
    sensible text. Deterministic for a given ``seed``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    return LoadedModel(model=model, tokenizer=tokenizer, model_id=model_id)


SCRIPT_BOOST = 1000.0


class ScriptedLlama(LlamaForCausalLM):
    """A random Llama carrying a bigram script for ``ScriptedRunner``.

    ``passes`` records every pass as its segments' ``(length, logits kept)``;
    ``calls`` records ``(segment length, logits kept)`` of every segment a pass
    returned logits for, so tests can count the drafted positions the engine
    verified; with ``record``, ``inputs`` gets each such segment's tokens and
    ``outputs`` its logits (one row per position kept), so tests can recompute
    what the engine derived from them.
    """

    def setup_script(
        self,
        script: dict[int, int] | None = None,
        poison: int | None = None,
        boost: float = SCRIPT_BOOST,
        default: int = -1,
    ) -> None:
        """``script`` maps a token to the token that must follow it (``boost`` added
        to its logit), ``default`` follows every other token (-1: none); a pass
        holding ``poison`` in any segment raises."""
        vocab = self.config.vocab_size
        self.boost = boost
        self.next_token = torch.full((vocab,), default, dtype=torch.long)
        for src, dst in (script or {}).items():
            self.next_token[src] = dst
        self.poison = poison
        self.calls: list[tuple[int, int]] = []
        self.passes: list[list[tuple[int, int]]] = []
        self.record = False
        self.inputs: list[list[int]] = []
        self.outputs: list[Any] = []

    def drafted_positions(self) -> int:
        """Drafted tokens fed in decode/verify passes (those ask logits for every input)."""
        return sum(length - 1 for length, keep in self.calls if keep == length)


class ScriptedRunner(LlamaRunner):
    """The engine's forward pass, then the script of the model it was built from."""

    def __init__(
        self,
        model: ScriptedLlama,
        quantization: Quantization,
        max_positions: int,
        dense_prefill: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, quantization, max_positions, dense_prefill, **kwargs)
        self.script = model

    def forward(self, segments: Any) -> list[Any]:
        script = self.script
        if script.poison is not None and any(script.poison in seg.tokens for seg in segments):
            raise RuntimeError("poisoned input")
        out = super().forward(segments)
        script.passes.append([(len(seg.tokens), seg.logits) for seg in segments])
        for seg, logits in zip(segments, out, strict=True):
            if logits is None:
                continue
            script.calls.append((len(seg.tokens), seg.logits))
            targets = script.next_token[torch.tensor(list(seg.tokens[-seg.logits :]))]
            for pos in torch.nonzero(targets >= 0).flatten().tolist():
                logits[pos, targets[pos]] += script.boost
            if script.record:
                script.inputs.append(list(seg.tokens))
                script.outputs.extend(logits.clone())
        return out


class FakeModel:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.hf_quantizer = object()
        self.config = SimpleNamespace(quantization_config={"quant_method": "gguf"})

    def save_pretrained(self, path: str) -> None:
        assert self.hf_quantizer is None and not hasattr(self.config, "quantization_config")
        (Path(path) / "model.safetensors").write_bytes(b"weights")
        if self.fail:
            raise OSError("disk full")


class FakeTokenizer:
    def save_pretrained(self, path: str) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")


def load_tokenizer_embedded(cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The embedded model's tokenizer: from the converted folder when it exists
    (fast), otherwise straight from the GGUF (a few seconds, no conversion)."""
    from transformers import AutoTokenizer

    gguf = model_store.find_embedded_gguf()
    folder = model_store.converted_dir(cache_dir or model_store.default_cache_dir(), gguf)
    if (folder / model_store._COMPLETE_MARKER).is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
