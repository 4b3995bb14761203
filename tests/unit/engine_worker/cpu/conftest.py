"""Fixtures for the CPU engine tests.

Mechanics tests run on a tiny random-weight Llama over the embedded model's
tokenizer (milliseconds per step), or on ``ScriptedLlama``, that model with a
bigram script (``tests/fakes/cpu.py``). Tests marked ``slow`` share one real
SmolLM2-135M-Instruct per session.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engine_worker.cpu.backend import CpuBackend  # noqa: E402
from engine_worker.cpu.llama import LlamaRunner  # noqa: E402
from engine_worker.cpu.model_store import LoadedModel, load_embedded  # noqa: E402
from engine_worker.settings import WorkerSettings  # noqa: E402
from protocol.messages import (  # noqa: E402
    Event,
    Finished,
    PrefillProgress,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
)
from tests.fakes.cpu import (  # noqa: E402
    ScriptedLlama,
    ScriptedRunner,
    add,
    load_tokenizer_embedded,
    tiny_random_llama,
)


@dataclass
class RunResult:
    """Events of one request and what they add up to."""

    events: list[Event] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenDelta))

    @property
    def deltas(self) -> list[TokenDelta]:
        return [e for e in self.events if isinstance(e, TokenDelta)]

    @property
    def progress(self) -> list[PrefillProgress]:
        return [e for e in self.events if isinstance(e, PrefillProgress)]

    @property
    def started(self) -> Started:
        first = self.events[0]
        assert isinstance(first, Started)
        return first

    @property
    def finished(self) -> Finished:
        last = self.events[-1]
        assert isinstance(last, Finished), last
        return last

    @property
    def error(self) -> RequestError:
        last = self.events[-1]
        assert isinstance(last, RequestError), last
        return last


def run_all(backend: CpuBackend, submits: Iterable[Submit], max_steps: int = 10_000) -> dict[str, RunResult]:
    """Admit ``submits`` and step until idle; events grouped by request id."""
    results: dict[str, RunResult] = {}
    for submit in submits:
        add(backend, submit)
        results[submit.request_id] = RunResult()
    for _ in range(max_steps):
        if not len(backend.active_ids()):
            break
        for event in backend.step():
            rid = event.request_id
            assert rid is not None
            results[rid].events.append(event)
    assert len(backend.active_ids()) == 0, "requests still active after max_steps"
    return results


def run_one(backend: CpuBackend, submit: Submit) -> RunResult:
    return run_all(backend, [submit])[submit.request_id]


def raw(request_id: str, prompt: str, **params: Any) -> Submit:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    return Submit(request_id=request_id, params=SamplingParams(**params), prompt=prompt)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    # No skip when the model package is missing: the test command installs it,
    # and a skip would hide a broken install.
    return load_tokenizer_embedded()


@pytest.fixture(scope="session")
def tiny(tokenizer: Any) -> LoadedModel:
    return tiny_random_llama(tokenizer, seed=0)


@pytest.fixture(scope="session")
def shaped(tokenizer: Any) -> LoadedModel:
    """Random weights in SmolLM2-135M's layer shapes (hidden 576, head_dim 64, 9
    query and 3 KV heads), four layers, over its tokenizer: where one bit of
    difference in a pass shows in the tokens, as in the real model (the tiny
    model's narrow rows rarely show it)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, model_id="shaped")


@pytest.fixture
def scripted(tiny: LoadedModel) -> Iterator[LoadedModel]:
    """A fresh ``ScriptedLlama`` with the tiny model's weights and no script yet."""
    model = ScriptedLlama(tiny.model.config)
    model.load_state_dict(tiny.model.state_dict())
    model.eval()
    model.setup_script()
    yield LoadedModel(model=model, tokenizer=tiny.tokenizer, model_id="scripted")


@pytest.fixture
def make_backend() -> Any:
    """``make_backend(loaded, **config)``: a ``CpuBackend`` over a loaded model."""

    def make(loaded: LoadedModel, **config: Any) -> CpuBackend:
        runner = ScriptedRunner if isinstance(loaded.model, ScriptedLlama) else LlamaRunner
        return CpuBackend.from_loaded(loaded, WorkerSettings(**config), runner_class=runner)

    return make


@pytest.fixture(scope="session")
def real_model() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct, converted into the default cache on first use."""
    return load_embedded()


@pytest.fixture(name="run_all")
def _run_all() -> Any:
    """``run_all(backend, submits) -> {request_id: RunResult}``."""
    return run_all


@pytest.fixture(name="run_one")
def _run_one() -> Any:
    """``run_one(backend, submit) -> RunResult``."""
    return run_one


@pytest.fixture(name="raw")
def _raw() -> Any:
    """``raw(request_id, prompt, **sampling_params) -> Submit`` (greedy, 8 tokens by default)."""
    return raw
