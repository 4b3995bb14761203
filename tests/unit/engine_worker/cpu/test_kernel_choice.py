"""``kernel_choice``: the start-up choice of kernels by measured speed, its cache and
``--cpu-kernels``; and every head and layer kernel giving the same logits."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from engine_worker.cpu import kernel_choice
from engine_worker.cpu.kernel_choice import Candidate, KernelUnavailable, pick, time_call
from engine_worker.cpu.kernels import int4
from engine_worker.cpu.llama import LlamaRunner, Segment
from engine_worker.cpu.model_store import LoadedModel
from engine_worker.cpu.quant import Int8Head, Kernels, Quantization, int8_rows
from engine_worker.settings import CPU_KERNELS, WorkerSettings, parse_cpu_kernels


class FakeClock:
    """A clock that only the candidates' calls move: each call costs what it is given."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(
        self, seconds_by_rows: dict[int, float], calls: list[int]
    ) -> Callable[[int], Callable[[], None]]:
        def call(rows: int) -> Callable[[], None]:
            def run() -> None:
                self.now += seconds_by_rows[rows]
                calls.append(rows)

            return run

        return call


def test_the_choice_is_the_faster_of_two_candidates_whose_speeds_it_is_given() -> None:
    clock = FakeClock()
    slow_calls: list[int] = []
    fast_calls: list[int] = []
    candidates = [
        Candidate("slow", clock.costing({1: 0.002, 8: 0.010}, slow_calls), lambda: True),
        Candidate("fast", clock.costing({1: 0.001, 8: 0.004}, fast_calls), lambda: True),
    ]
    name, times = pick(candidates, clock=clock)
    assert name == "fast"
    assert times == {"slow": pytest.approx((2000.0, 10000.0)), "fast": pytest.approx((1000.0, 4000.0))}
    # each timed for about the budget after a warm-up call, at both row counts
    assert slow_calls.count(1) == 1 + 5 and fast_calls.count(8) == 1 + 3
    # order does not matter, nor does a faster 1-row time alone: the total decides
    other = [
        Candidate("b", clock.costing({1: 0.001, 8: 0.020}, []), lambda: True),
        Candidate("a", clock.costing({1: 0.002, 8: 0.010}, []), lambda: True),
    ]
    assert pick(other, clock=clock)[0] == "a"


def test_a_faster_candidate_that_is_not_exact_gives_way(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    candidates = [
        Candidate("wrong", clock.costing({1: 0.001, 8: 0.001}, []), lambda: False),
        Candidate("right", clock.costing({1: 0.003, 8: 0.003}, []), lambda: True),
    ]
    with caplog.at_level(logging.WARNING):
        assert pick(candidates, clock=clock)[0] == "right"
    assert "kernel wrong is not exact" in caplog.text
    assert pick(candidates[:1], clock=clock)[0] is None


def test_a_very_slow_candidate_is_not_timed_further_and_an_unavailable_one_is_left_out() -> None:
    clock = FakeClock()
    slow_calls: list[int] = []

    def unavailable(rows: int) -> Callable[[], None]:
        raise KernelUnavailable("not on this CPU")

    candidates = [
        Candidate("quick", clock.costing({1: 0.001, 8: 0.002}, []), lambda: True),
        Candidate("reference", clock.costing({1: 1.5, 8: 9.0}, slow_calls), lambda: True),
        Candidate("missing", unavailable, lambda: True),
    ]
    name, times = pick(candidates, clock=clock)
    assert name == "quick" and set(times) == {"quick", "reference"}
    assert slow_calls == [1] and times["reference"] == (pytest.approx(1.5e6), None)


def test_time_call_is_the_least_after_a_warm_up() -> None:
    clock = FakeClock()
    costs = iter([0.5, 0.001, 0.003, 0.002, 0.002])

    def call() -> None:
        clock.now += next(costs, 0.002)

    # a neighbour's load only adds time: the least call is the kernel's own
    assert time_call(call, budget_s=0.005, clock=clock) == pytest.approx(0.001)


def _tiny_runner_logits(loaded: LoadedModel, kernels: Kernels, quantization: Quantization) -> torch.Tensor:
    runner = LlamaRunner(loaded.model, quantization, 64, kernels=kernels)
    assert runner.kernels == kernels
    kv = runner.new_kv(16)
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        prompt = runner.forward([Segment(kv, ids[:11], 11)])[0]
        step = runner.forward([Segment(kv, ids[11:], 1)])[0]  # one decode position
    assert prompt is not None and step is not None
    return torch.cat([prompt, step])


def test_each_head_kernel_gives_the_same_logits_bit_for_bit(tiny: LoadedModel) -> None:
    codes, scales = int8_rows(tiny.model.get_output_embeddings().weight)
    heads = ["int_mm"]
    for kernel in ("vnni", "onednn"):  # where this machine runs them exactly, as the choice requires
        try:
            if Int8Head.of_codes(codes, scales, kernel).exact_on_probe(codes):
                heads.append(kernel)
        except ValueError:
            pass
    if int4.available():
        assert "vnni" in heads
    layers = Kernels.default(Quantization.INT4).layers
    logits = [_tiny_runner_logits(tiny, Kernels(head, layers, "sdpa"), Quantization.INT4) for head in heads]
    for other in logits[1:]:
        assert torch.equal(other, logits[0])


def test_each_layer_and_attention_kernel_gives_the_same_logits(tiny: LoadedModel) -> None:
    """The int4 kernels do different arithmetic (int8 activations times codes, or
    bfloat16 activations times unpacked weights): the same logits within int4's
    error, checked against the float32 pass. The two attention kernels agree to
    float32 rounding."""
    if not int4.available():
        pytest.skip("this CPU does not run the VNNI kernels")
    reference = _tiny_runner_logits(tiny, Kernels("float", "torch", "sdpa"), Quantization.NONE)
    scale = reference.abs().max()
    results = {}
    for layers, attention in (("vnni", "llvm"), ("vnni", "sdpa"), ("torch", "sdpa")):
        results[layers, attention] = got = _tiny_runner_logits(
            tiny, Kernels("int_mm", layers, attention), Quantization.INT4
        )
        assert (got - reference).abs().max() < 0.1 * scale, (layers, attention)
    torch.testing.assert_close(results["vnni", "llvm"], results["vnni", "sdpa"], rtol=1e-4, atol=1e-4)
    unquantized = _tiny_runner_logits(tiny, Kernels("float", "torch", "llvm"), Quantization.NONE)
    torch.testing.assert_close(unquantized, reference, rtol=1e-4, atol=1e-4)


def _counting_builders(calls: list[str]) -> dict[str, Callable[[Any], list[Candidate]]]:
    """Candidates of every role that record each timing call and cost nothing."""

    def builder(role: str) -> Callable[[Any], list[Candidate]]:
        def make(shapes: Any) -> list[Candidate]:
            def candidate(name: str) -> Candidate:
                return Candidate(name, lambda rows: lambda: calls.append(f"{role}={name}"), lambda: True)

            return [candidate(n) for n in kernel_choice.CANDIDATES[role]]

        return make

    return {role: builder(role) for role in kernel_choice.ROLES}


def test_a_second_start_reads_the_cached_choice(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    calls: list[str] = []
    builders = _counting_builders(calls)
    first = kernel_choice.resolve(tiny.model, Quantization.INT4, cache_dir=tmp_path, make_candidates=builders)
    assert calls and set(first.source.values()) <= {"measured", "only"}
    files = list((tmp_path / "kernels").iterdir())
    assert len(files) == 1 and json.loads(files[0].read_text())["kernels"] == first.kernels.names()
    calls.clear()
    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    second = kernel_choice.resolve(
        tiny.model, Quantization.INT4, cache_dir=tmp_path, make_candidates=builders
    )
    assert calls == [] and second.kernels == first.kernels
    assert "measured" not in second.source.values() and "cached" in second.source.values()
    assert "head=" in second.line() and "(cached;" in second.line()
    # another thread count is another machine's choice
    before = kernel_choice.fingerprint({}, Quantization.INT4, torch.float32)
    with mock.patch.object(torch, "get_num_threads", return_value=torch.get_num_threads() + 1):
        assert kernel_choice.fingerprint({}, Quantization.INT4, torch.float32) != before
        third = kernel_choice.resolve(
            tiny.model, Quantization.INT4, cache_dir=tmp_path, make_candidates=builders
        )
    assert calls and "measured" in third.source.values()


def test_the_backend_logs_the_choice_and_a_second_start_reads_it(
    tiny: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from engine_worker.cpu.backend import CpuBackend

    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    loaded = dataclasses.replace(tiny, folder=folder)
    settings = WorkerSettings(cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.INFO):
        first = CpuBackend(settings, loaded=loaded)
        monkeypatch.setattr(kernel_choice, "_MEASURED", {})
        second = CpuBackend(settings, loaded=loaded)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels:")]
    assert len(lines) == 2 and "measured" in lines[0] and "measured" not in lines[1] and "cached" in lines[1]
    assert dict(first.info.kernels) == dict(second.info.kernels) == first.runner.kernels.names()


def test_forcing_a_kernel(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    choice = kernel_choice.resolve(tiny.model, Quantization.INT4, forced="head=int_mm,attention=sdpa")
    assert choice.kernels.head == "int_mm" and choice.kernels.attention == "sdpa"
    assert choice.source["head"] == choice.source["attention"] == "forced"
    with pytest.raises(ValueError, match="not a candidate with --quantization int8"):
        kernel_choice.resolve(tiny.model, Quantization.INT8, forced="layers=vnni")
    with (
        mock.patch.object(int4, "available", return_value=False),
        pytest.raises(ValueError, match="layers=vnni"),
    ):
        kernel_choice.resolve(tiny.model, Quantization.INT4, forced="layers=vnni")
    # attention's candidates follow the layers: the LLVM attention needs float32 activations
    with pytest.raises(ValueError, match="attention=llvm: not a candidate"):
        kernel_choice.resolve(tiny.model, Quantization.INT4, forced="layers=torch,attention=llvm")


def test_the_option_names_every_candidate_and_refuses_others() -> None:
    assert CPU_KERNELS == kernel_choice.CANDIDATES
    assert parse_cpu_kernels("head=onednn, layers=torch") == {"head": "onednn", "layers": "torch"}
    for bad in ("head", "head=fast", "tail=int_mm", "head=int_mm,head=onednn", ""):
        with pytest.raises(ValueError, match="--cpu-kernels"):
            parse_cpu_kernels(bad)
    with pytest.raises(ValueError, match="--cpu-kernels"):
        WorkerSettings(cpu_kernels="head=nope")
    with pytest.raises(ValueError, match="cpu_kernels: backend=synthetic"):
        WorkerSettings(backend="synthetic", cpu_kernels="head=int_mm")


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "[1, 2, 3]",
        '{"kernels": {"head": "bogus"}}',
        '{"kernels": {"head": "int_mm", "layers": "vnni", "attention": "llvm"}, "times_us": []}',
        '{"kernels": {"head": "int_mm", "layers": "vnni", "attention": "llvm"}, "times_us": null}',
        '{"kernels": {"head": "int_mm"}, "times_us": {"head": {"vnni": 5}}}',
        '{"kernels": {"head": "int_mm"}, "times_us": {"head": {"vnni": ["ab"], "int_mm": [1, null]}}}',
    ],
)
def test_a_damaged_cache_file_never_stops_a_start(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    builders = _counting_builders([])
    kernel_choice.resolve(tiny.model, Quantization.INT4, cache_dir=tmp_path, make_candidates=builders)
    (path,) = (tmp_path / "kernels").iterdir()
    path.write_text(body)
    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    again = kernel_choice.resolve(tiny.model, Quantization.INT4, cache_dir=tmp_path, make_candidates=builders)
    assert again.line().startswith("CPU kernels: head=")
    for role, name in again.kernels.names().items():
        assert name in kernel_choice.CANDIDATES[role]
    if 'int_mm": [1, null]' in body:
        assert again.times_us["head"] == {"int_mm": (1.0, None)}


def test_a_failed_write_leaves_no_temporary_file(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    key = kernel_choice.fingerprint(
        kernel_choice.Shapes.of(tiny.model).key(), Quantization.INT4, torch.float32
    )
    (tmp_path / "kernels" / f"{key}.json").mkdir(parents=True)  # a folder where the file goes
    with caplog.at_level(logging.WARNING):
        kernel_choice.resolve(
            tiny.model, Quantization.INT4, cache_dir=tmp_path, make_candidates=_counting_builders([])
        )
    assert "could not keep the kernel choice" in caplog.text
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [f"{key}.json"]


def test_degenerate_weights_fall_back_to_the_flags_default(
    tiny: LoadedModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernel_choice, "_MEASURED", {})
    never = {
        role: (
            lambda shapes, role=role: [
                Candidate(n, lambda rows: lambda: None, lambda: False) for n in kernel_choice.CANDIDATES[role]
            ]
        )
        for role in kernel_choice.ROLES
    }
    with caplog.at_level(logging.WARNING):
        choice = kernel_choice.resolve(tiny.model, Quantization.INT4, make_candidates=never)
    assert choice.kernels == Kernels.default(Quantization.INT4)
    assert "no head kernel was exact" in caplog.text
