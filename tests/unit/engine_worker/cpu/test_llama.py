"""``LlamaRunner``: the forward pass against transformers' own, quantization, and
batch invariance (a sequence's logits and KV are bitwise the same alone,
batched, and in a verify pass)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine_worker.cpu.kernels import int4
from engine_worker.cpu.llama import DENSE_MIN_TOKENS, LlamaRunner, Segment, UnsupportedModel
from engine_worker.cpu.quant import Quantization, QuantizedLinear

KERNELS = [
    pytest.param(Quantization.INT4, "vnni", id="int4-vnni"),
    pytest.param(Quantization.INT4, "torch", id="int4-torch"),
    pytest.param(Quantization.INT8, "torch", id="int8"),
]
"""The quantized kernels: int4 through ``vnni`` (where the CPU runs it) and through
torch's ``_weight_int4pack_mm_for_cpu``, and int8."""


@contextmanager
def _kernel(kernel: str) -> Iterator[None]:
    """Layers built inside use ``kernel`` for int4 (skips ``vnni`` where unavailable)."""
    if kernel == "vnni":
        if not int4.available():
            pytest.skip("this CPU does not run the VNNI kernel (AVX-512 VNNI, llvmlite)")
        yield
    else:
        with mock.patch.object(int4, "available", return_value=False):
            yield


def _ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(input_ids=torch.tensor([ids])).logits[0]
    return logits


@pytest.mark.parametrize("chunks", [[50], [7] * 7 + [1], [30, 1, 19]])
def test_unquantized_pass_matches_transformers_in_any_chunking(tiny: Any, chunks: list[int]) -> None:
    ids = _ids(sum(chunks), seed=1)
    expected = _reference(tiny.model, ids)
    runner = LlamaRunner(tiny.model, Quantization.NONE, 256)
    kv = runner.new_kv(4)  # forces regrowths
    out, start = [], 0
    with torch.inference_mode():
        for n in chunks:
            logits = runner.forward([Segment(kv, ids[start : start + n], n)])[0]
            assert logits is not None
            out.append(logits)
            start += n
    assert kv.length == len(ids)
    torch.testing.assert_close(torch.cat(out), expected, rtol=1e-4, atol=1e-4)


def test_qwen2_biases_and_truncated_kv_match_transformers() -> None:
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
        for layer in model.model.layers:  # random, non-zero q/k/v biases
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    ids = _ids(40, seed=2, vocab=300)
    expected = _reference(model, ids)
    runner = LlamaRunner(model, Quantization.NONE, 256)
    kv = runner.new_kv(8)
    with torch.inference_mode():
        runner.forward([Segment(kv, ids, 0)])
        kv.truncate(25)  # drop the tail, feed it again
        again = runner.forward([Segment(kv, ids[25:], 15)])[0]
    assert again is not None
    torch.testing.assert_close(again, expected[25:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("mode", "kernel"), KERNELS)
def test_quantized_linear_rows_are_computed_as_alone(mode: Quantization, kernel: str) -> None:
    weight = torch.randn(192, 96, generator=torch.Generator().manual_seed(3))
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    with _kernel(kernel):
        linear = QuantizedLinear(weight, None, mode)
    assert (linear.input_dtype == torch.float32) == (kernel == "vnni")
    alone = torch.cat([linear(x[i : i + 1]) for i in range(40)])
    for m in (2, 3, 4, 5, 8, 17, 40):
        assert torch.equal(linear(x[:m]), alone[:m]), m
    # and close to the float32 product: int4 keeps 16 levels per group of 32
    exact = x @ weight.T
    error = (alone - exact).abs().max() / exact.abs().max()
    assert error < (0.1 if mode is Quantization.INT4 else 0.02)


@pytest.mark.parametrize("kernel", ["vnni", "torch"])
def test_int4_reproduces_weights_that_have_16_levels_per_group(kernel: str) -> None:
    """Q4_1-style weights (a scale and a minimum per 32 inputs, codes 0..15) come
    back to within the bfloat16 rounding of scale and offset (torch's kernel; the
    VNNI kernel keeps them in float32, and a one-hot row quantizes exactly)."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (64, 128), generator=gen).float()
    codes[:, ::32] = 0  # every group uses its lowest and highest level
    codes[:, 1::32] = 15
    scale = torch.rand(64, 4, generator=gen) * 0.01 + 0.001
    low = -8 * scale + torch.randn(64, 4, generator=gen) * 0.001
    weight = (codes.view(64, 4, 32) * scale[..., None] + low[..., None]).view(64, 128)
    with _kernel(kernel):
        linear = QuantizedLinear(weight, None, Quantization.INT4)
    identity = torch.eye(128)
    recovered = linear(identity).T  # [out, in]
    # scale and offset are stored in bfloat16: relative error 2^-8 each
    tolerance = 16 * scale.max() * 2**-8 + low.abs().max() * 2**-8
    assert (recovered - weight).abs().max() <= tolerance


def test_int4_falls_back_to_int8_when_the_width_is_not_a_multiple_of_32() -> None:
    assert QuantizedLinear(torch.randn(8, 48), None, Quantization.INT4).mode is Quantization.INT8


@pytest.fixture(scope="module")
def smollm_shaped() -> Any:
    """Random weights in SmolLM2-135M's layer shapes (head_dim 64, 9 query and 3
    KV heads), four layers: the shapes where fused attention kernels give a row
    a result that depends on the other rows of the call."""
    config = LlamaConfig(
        vocab_size=2000,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(("mode", "kernel"), KERNELS)
def test_batched_and_verify_passes_are_bitwise_what_a_lone_sequence_gets(
    smollm_shaped: Any, mode: Quantization, kernel: str
) -> None:
    with _kernel(kernel):
        runner = LlamaRunner(smollm_shaped, mode, 512)
    prompts = [_ids(n, seed=10 + n, vocab=2000) for n in (5, 33, 70, 12)]
    follow = [_ids(12, seed=20 + i, vocab=2000) for i in range(4)]
    with torch.inference_mode():
        # alone: each prompt in one chunk, then its twelve tokens one at a time
        alone = []
        for p, f in zip(prompts, follow, strict=True):
            kv = runner.new_kv(8)
            first = runner.forward([Segment(kv, p, 1)])[0]
            steps = [runner.forward([Segment(kv, [t], 1)])[0] for t in f]
            alone.append((first, torch.cat(steps), kv.export().clone()))
        # together: one pass for all prompts, then one pass per position; the
        # third sequence feeds its twelve tokens as one verify segment
        kvs = [runner.new_kv(8) for _ in prompts]
        firsts = runner.forward([Segment(kv, p, 1) for kv, p in zip(kvs, prompts, strict=True)])
        steps_together: list[list[torch.Tensor]] = [[], [], [], []]
        verify = runner.forward([Segment(kvs[2], follow[2], 12)])[0]
        for j in range(12):
            out = runner.forward([Segment(kvs[i], [follow[i][j]], 1) for i in (0, 1, 3)])
            for i, logits in zip((0, 1, 3), out, strict=True):
                assert logits is not None
                steps_together[i].append(logits)
    for i, (first, steps, kv) in enumerate(alone):
        assert torch.equal(firsts[i], first)  # type: ignore[arg-type]
        got = verify if i == 2 else torch.cat(steps_together[i])
        assert torch.equal(got, steps), i  # type: ignore[arg-type]
        assert torch.equal(kvs[i].export(), kv), i


def test_a_failed_pass_leaves_every_kv_length_unchanged(tiny: Any) -> None:
    runner = LlamaRunner(tiny.model, Quantization.INT4, 64)
    a, b = runner.new_kv(8), runner.new_kv(8)
    with torch.inference_mode():
        runner.forward([Segment(a, [1, 2, 3], 1)])
        with pytest.raises(ValueError, match="past the model"):
            runner.forward([Segment(a, [4], 1), Segment(b, list(range(70)), 1)])
    assert (a.length, b.length) == (3, 0)


def test_unsupported_architectures_are_refused() -> None:
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    model.config.model_type = "gemma"
    with pytest.raises(UnsupportedModel, match="gemma"):
        LlamaRunner(model, Quantization.NONE, 16)
    model.config.model_type = "llama"
    model.config.hidden_act = "gelu"
    with pytest.raises(UnsupportedModel, match="gelu"):
        LlamaRunner(model, Quantization.NONE, 16)


def test_dense_prefill_is_close_to_the_quantized_pass_and_used_only_for_long_chunks(
    smollm_shaped: Any,
) -> None:
    ids = _ids(80, seed=7, vocab=2000)
    dense = LlamaRunner(smollm_shaped, Quantization.INT4, 256, dense_prefill=True)
    quantized = LlamaRunner(smollm_shaped, Quantization.INT4, 256, dense_prefill=False)
    reference = _reference(smollm_shaped, ids)[-1]
    with torch.inference_mode():
        short = [
            r.forward([Segment(r.new_kv(8), ids[: DENSE_MIN_TOKENS - 1], 1)])[0] for r in (dense, quantized)
        ]
        long = [r.forward([Segment(r.new_kv(8), ids, 1)])[0] for r in (dense, quantized)]
    assert torch.equal(short[0], short[1])  # below the threshold: the quantized kernels
    assert not torch.equal(long[0], long[1])
    for logits in long:
        assert logits is not None
        # both near float32; the bfloat16 weights nearer than the int4 ones
        assert (logits[0] - reference).abs().max() < 0.25 * reference.abs().max()
    assert (long[0][0] - reference).abs().mean() < (long[1][0] - reference).abs().mean()  # type: ignore[index]
