"""The loader against the fake ``exllamav3`` package: load order, keyword names
(the fake rejects any name 1.6.5 does not have), defaults and the progress bar."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from engine_worker.admission import checked_prepare
from engine_worker.backend import ModelInfo, RequestRejected
from engine_worker.exllamav3 import loader
from engine_worker.exllamav3.sampling import FLOAT32_MAX
from engine_worker.settings import DraftMode, WorkerSettings
from protocol.messages import ChatMessage, Finished, SamplingParams, Submit, TokenDelta
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import add, chat, raw, run, text_of

torch = pytest.importorskip("torch")


FREE_VRAM = 80 * loader.GIB


def _model_dir(root: Path, name: str, chat_template: str | None = fx.CHATML_TEMPLATE, **extra: Any) -> Path:
    """A model directory: ``config.json`` and the tokenizer files ``transformers`` loads
    (``fx.write_hf_tokenizer``, with ``chat_template``)."""
    d = root / name
    d.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048, "eos_token_id": [257, 259]}
    (d / "config.json").write_text(json.dumps({**cfg, **extra}))
    fx.write_hf_tokenizer(str(d), chat_template)
    return d


@pytest.fixture
def fake_exl3(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Installs the fake as ``exllamav3``, pretends CUDA exists with ``FREE_VRAM`` free, and
    records the order of model loads as ``"<dir name>/<component>"``."""
    monkeypatch.setitem(sys.modules, "exllamav3", fx)
    # create_ll_tokenizer lives in exllamav3.generator.filter.llguidance (loader.ll_tokenizer)
    for name in (
        "exllamav3.generator",
        "exllamav3.generator.filter",
        "exllamav3.generator.filter.llguidance",
    ):
        monkeypatch.setitem(sys.modules, name, fx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loader, "_free_vram_bytes", lambda split: FREE_VRAM)
    order: list[str] = []
    real = fx.Model.load_gen

    def load_gen(self: fx.Model, **kw: Any) -> Any:
        assert self.config is not None
        order.append(f"{Path(self.config.directory).name}/{self.component}")
        return real(self, **kw)

    monkeypatch.setattr(fx.Model, "load_gen", load_gen)
    return order


def _gen(backend: Any) -> fx.Generator:
    g = backend._h.generator
    assert isinstance(g, fx.Generator)
    return g


def test_ngram_load(tmp_path: Path, fake_exl3: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    d = _model_dir(tmp_path, "tiny-exl3")
    cfg = WorkerSettings(
        backend="exllamav3",
        model_dir=d,
        draft_mode=DraftMode.NGRAM,
        cache_mode="8,6",
        chunk_size=512,
        ngram_match_min=3,
    )
    backend = loader.build_backend(cfg)
    g = _gen(backend)
    # default cache: the model's context plus one token and the draft window, in whole pages
    assert g.cache.max_num_tokens == -(-(2048 + 1 + 4) // 256) * 256
    assert g.cache.layer_type is fx.CacheLayer_quant and g.cache.bits == (8, 6)
    assert g.cache.max_history == 4 and g.cache.max_batch_size == 32
    assert (g.ngram_match_min, g.num_draft_tokens, g.max_chunk_size, g.max_batch_size) == (3, 4, 512, 32)
    assert g.draft_model is None
    model = g.model
    assert model.load_calls[0]["caches_attached"] == 1  # the cache existed before load()
    assert model.load_calls[0]["max_chunk_size"] == 512
    assert model.warmup_calls and model.warmup_calls[0]["cache"] is g.cache
    assert fake_exl3 == ["tiny-exl3/text"]
    assert backend.info == ModelInfo(
        "tiny-exl3",
        2048,
        "ngram",
        kv_cache_tokens=g.cache.max_num_tokens,
        max_batch_size=32,
        longest_token_chars=max(len(p) for p in fx.Tokenizer().get_id_to_piece_list(False)),
        grammar=True,
        logprobs=True,
        chat_template=fx.CHATML_TEMPLATE,
        template_tools=True,
        kv_block_tokens=256,  # ExLlamaV3's page (constants.py:2)
        vocab_size=fx.VOCAB_SIZE,
        max_logit_bias=FLOAT32_MAX,
        logit_bias_ban=True,
        context_settings="settings: max_seq_len, cache_size",
        banned_strings=True,
        # the loader builds the answer filter (grammar.answer_filter_factory)
        grammar_while_thinking=True,
        logprobs_while_thinking=True,
    )
    err = capsys.readouterr().err
    assert "Loading tiny-exl3" in err and "5/5" in err


def test_draft_model_is_loaded_first_with_its_own_cache_mode(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = _model_dir(tmp_path, "big")
    dd = _model_dir(tmp_path, "small")
    cfg = WorkerSettings(
        backend="exllamav3",
        model_dir=d,
        draft_mode=DraftMode.DRAFT_MODEL,
        draft_model_dir=dd,
        cache_size=4096,
        cache_mode="FP16",
        draft_cache_mode="4,4",
        gpu_split=(10, 12),
        draft_gpu_split=(3,),
        num_draft_tokens=3,
        warmup=False,
    )
    backend = loader.build_backend(cfg)
    g = _gen(backend)
    assert fake_exl3 == ["small/text", "big/text"]
    assert g.draft_cache is not None and g.draft_model is not None
    assert g.draft_cache.max_num_tokens == g.cache.max_num_tokens == 4096
    assert g.draft_cache.bits == (4, 4) and g.cache.layer_type is fx.CacheLayer_fp16
    assert g.model.load_calls[0]["draft_model"] is g.draft_model
    assert g.model.load_calls[0]["use_per_device"] == [10.0, 12.0]
    assert g.draft_model.load_calls[0]["use_per_device"] == [3.0]
    assert g.num_draft_tokens == 3 and not g.model.warmup_calls
    assert backend.info.drafting == "draft_model"
    # cache_size given, max_seq_len not: the model's context, capped by the cache (TabbyAPI)
    assert backend.info.max_context_tokens == 2048


def test_draft_model_without_its_own_split_is_placed_automatically(
    tmp_path: Path, fake_exl3: list[str]
) -> None:
    # use_per_device counts on top of what is already allocated (model/model.py:522-526): the
    # main split reused for the drafter would let both together take about twice of it.
    cfg = WorkerSettings(
        backend="exllamav3",
        model_dir=_model_dir(tmp_path, "big"),
        draft_mode=DraftMode.DRAFT_MODEL,
        draft_model_dir=_model_dir(tmp_path, "small"),
        gpu_split=(10, 12),
        warmup=False,
    )
    g = _gen(loader.build_backend(cfg))
    assert g.draft_model is not None
    assert g.draft_model.load_calls[0]["use_per_device"] is None
    assert g.model.load_calls[0]["use_per_device"] == [10.0, 12.0]


def test_moe_cpu_hosts_are_started_after_each_load(
    tmp_path: Path, fake_exl3: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Model.load() starts them after draining load_gen (model/model.py:767-772); the loader
    # drains load_gen itself, so it must do the same.
    started: list[tuple[str, bool]] = []

    class Host:
        def __init__(self, model: fx.Model) -> None:
            self.model = model

        def ensure_started(self) -> None:
            started.append((self.model.component, self.model.loaded))

    real = fx.Model.from_config

    def from_config(config: fx.Config, component: str = "text") -> fx.Model:
        model = real(config, component)
        setattr(config, "moe_cpu_hosts", {component: Host(model)})  # noqa: B010
        return model

    monkeypatch.setattr(fx.Model, "from_config", staticmethod(from_config))
    loader.load_engine(
        WorkerSettings(backend="exllamav3", model_dir=_model_dir(tmp_path, "moe"), warmup=False)
    )
    assert started == [("text", True)]


def test_failed_warmup_passes_are_logged(
    tmp_path: Path, fake_exl3: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fx.Model, "warmup_failures", ("gemm bsz 8", "attn long"))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=_model_dir(tmp_path, "m")))
    (rec,) = [r for r in caplog.records if "warmup" in r.getMessage()]
    assert rec.levelno == logging.WARNING and "gemm bsz 8, attn long" in rec.getMessage()


def test_mtp_uses_the_models_own_head(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = _model_dir(tmp_path, "mtp-model", fake_mtp=True)
    backend = loader.build_backend(WorkerSettings(backend="exllamav3", model_dir=d, draft_mode=DraftMode.MTP))
    g = _gen(backend)
    assert g.draft_model is not None and g.draft_model.component == "mtp"
    assert fake_exl3 == ["mtp-model/mtp", "mtp-model/text"]
    assert g.num_draft_tokens == 2  # the head's preferred draft length


def test_mtp_on_a_model_without_a_head_is_refused(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = _model_dir(tmp_path, "plain")
    with pytest.raises(ValueError, match="no MTP head"):
        loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=d, draft_mode=DraftMode.MTP))


def test_max_seq_len_sets_context_and_default_cache(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = _model_dir(tmp_path, "m")
    backend = loader.build_backend(
        WorkerSettings(backend="exllamav3", model_dir=d, max_seq_len=1000, max_batch_size=3)
    )
    g = _gen(backend)
    assert backend.info.max_context_tokens == 1000
    assert g.cache.max_num_tokens == 1024 and g.max_batch_size == 3
    assert g.model.config is not None and g.model.config.dynamic_seq_len == 1000


def test_without_cuda_the_loader_refuses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "exllamav3", fx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=_model_dir(tmp_path, "m")))


def test_loaded_backend_serves_chat_and_raw_prompts(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = _model_dir(tmp_path, "m")
    backend = loader.build_backend(WorkerSettings(backend="exllamav3", model_dir=d, warmup=False))
    g = _gen(backend)
    g.model.script = fx.reply(b"ok \xe6\x97")  # ends on a cut character, flushed via decode()
    add(backend, chat("c", "hello"))
    add(backend, raw("r", "<s>already has BOS"))
    once = fx.Tokenizer().encode("<s>already has BOS", encode_special_tokens=True)
    assert g.pending_jobs[1].input_ids == once.tolist()[0]
    events = run(backend)
    assert text_of(events, "c") == b"ok \xe6\x97".decode("utf-8", errors="replace")
    assert any(isinstance(e, TokenDelta) for e in events)
    assert sum(isinstance(e, Finished) for e in events) == 2
    backend.close()
    assert g.closed and not g.model.loaded


@pytest.mark.parametrize(
    ("tok", "expected"),
    [
        (SimpleNamespace(bos_token_id=None), False),
        (SimpleNamespace(bos_token_id=1, tokenizer_config_dict={"add_bos_token": True}), True),
        (
            SimpleNamespace(
                bos_token_id=1,
                tokenizer_config_dict={},
                tokenizer=SimpleNamespace(encode=lambda s, add_special_tokens: SimpleNamespace(ids=[1, 64])),
            ),
            True,
        ),
        (
            SimpleNamespace(
                bos_token_id=151643,
                tokenizer_config_dict={"add_bos_token": False},
                tokenizer=SimpleNamespace(encode=lambda s, add_special_tokens: SimpleNamespace(ids=[64])),
            ),
            False,
        ),
    ],
)
def test_bos_follows_the_models_tokenizer(tok: Any, expected: bool) -> None:
    assert loader._wants_bos(tok) is expected


def test_dataclass_replace_keeps_validation() -> None:
    c = WorkerSettings(backend="exllamav3", model_dir=Path("/m"))
    with pytest.raises(ValueError, match="chunk_size"):
        dataclasses.replace(c, chunk_size=10)


# ------------------------------------------------------------------ chat template at start-up


def test_chat_template_is_loaded_before_the_weights_and_used_as_loaded(
    tmp_path: Path, fake_exl3: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    calls: list[dict[str, Any]] = []
    real = AutoTokenizer.from_pretrained

    def from_pretrained(path: str, **kw: Any) -> Any:
        calls.append({"path": path, "loaded": list(fake_exl3), **kw})
        return real(path, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    d = _model_dir(tmp_path, "m", eos_token_id=257)  # the EOS list does not name <|im_end|>
    handle = loader.load_engine(
        WorkerSettings(backend="exllamav3", model_dir=d, trust_remote_code=True, warmup=False)
    )
    assert calls == [{"path": str(d), "loaded": [], "trust_remote_code": True}]
    ids = handle.encode_chat([{"role": "user", "content": "hi"}], True, None)
    assert len(calls) == 1  # rendering used the tokenizer loaded at start-up
    assert ids.tolist()[0] == fx.ChatMLTemplate().apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    # the template ends an assistant turn with <|im_end|>: a stop token and a stop string
    assert handle.stop_strings == ("<|im_end|>",)
    assert handle.eos_token_ids == (fx.EOS, fx.IM_END)


def test_tools_and_tool_turns_reach_a_template_that_renders_them(
    tmp_path: Path, fake_exl3: list[str]
) -> None:
    d = _model_dir(tmp_path, "qwen-like", chat_template=fx.QWEN_TOOLS_TEMPLATE)
    backend = loader.build_backend(WorkerSettings(backend="exllamav3", model_dir=d, warmup=False))
    info = backend.info
    assert info.chat_template == fx.QWEN_TOOLS_TEMPLATE and info.template_tools
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    submit = Submit(
        "t",
        SamplingParams(max_tokens=8),
        messages=(
            ChatMessage("user", "Weather in Paris?"),
            ChatMessage("assistant", "", tool_calls_json=json.dumps([call])),
            ChatMessage("tool", "22 C, sunny", tool_call_id="call_1", name="get_weather"),
        ),
        tools_json=json.dumps(tools),
    )
    prepared = checked_prepare(backend, submit)
    prompt = fx.Tokenizer._decode(prepared.prompt.ids.tolist()[0], True)
    assert json.dumps(tools[0]) in prompt  # the schema, as the template's tojson writes it
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # without tools the same template renders no tools block
    plain = checked_prepare(
        backend, msgspec.structs.replace(submit, tools_json=None, messages=submit.messages[:1])
    )
    assert "<tools>" not in fx.Tokenizer._decode(plain.prompt.ids.tolist()[0], True)


def test_a_grammar_compiles_against_the_models_tokenizer(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = _model_dir(tmp_path, "m")
    backend = loader.build_backend(WorkerSettings(backend="exllamav3", model_dir=d, warmup=False))
    assert backend.info.grammar and backend.info.logprobs
    submit = chat(
        "g", "yes or no?", grammar='start: "yes" | "no"', grammar_param="response_format", logprobs=2
    )
    prepared = checked_prepare(backend, submit)
    (flt,) = prepared.prompt.filters
    assert isinstance(flt, fx.LLGuidanceFilter)
    # config.json's EOS list, as create_ll_tokenizer reads it (generator/filter/llguidance.py:23-28)
    assert fx.create_ll_tokenizer(backend._h.generator.tokenizer).eos_tokens == [257, 259]
    with pytest.raises(RequestRejected) as e:
        checked_prepare(backend, chat("b", "x", grammar="start: (", grammar_param="response_format"))
    assert e.value.param == "response_format" and "invalid grammar" in e.value.message


def test_a_model_without_a_chat_template_fails_at_start_before_loading(
    tmp_path: Path, fake_exl3: list[str]
) -> None:
    d = _model_dir(tmp_path, "base-model", chat_template=None)
    with pytest.raises(ValueError, match="base-model has no chat template") as e:
        loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=d))
    assert "\n" not in str(e.value)
    assert fake_exl3 == []  # no weights were read


def test_a_template_that_fails_on_a_plain_conversation_fails_at_start(
    tmp_path: Path, fake_exl3: list[str]
) -> None:
    d = _model_dir(tmp_path, "m", chat_template="{{ raise_exception('system message required') }}")
    with pytest.raises(ValueError, match=r"fails on a one-message conversation.*system message required"):
        loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=d))


def test_a_tokenizer_needing_remote_code_names_the_option(
    tmp_path: Path, fake_exl3: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    def refuse(path: str, **kw: Any) -> Any:
        raise ValueError(f"{path} contains custom code ... set the option `trust_remote_code=True`")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(ValueError, match="pass --trust-remote-code if you trust"):
        loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=_model_dir(tmp_path, "m")))
    assert fake_exl3 == []


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (fx.CHATML_TEMPLATE, "<|im_end|>"),
        (
            "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] }}<|eot_id|>{% endfor %}",
            "<|eot_id|>",
        ),
        (
            "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
            "<end_of_turn>",
        ),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", None),
    ],
)
def test_turn_end_is_what_follows_an_assistant_message(template: str, expected: str | None) -> None:
    from engine_worker.exllamav3 import chat_template

    tok = SimpleNamespace(
        chat_template=template,
        apply_chat_template=lambda messages, add_generation_prompt, tokenize: _jinja(
            template, messages, add_generation_prompt
        ),
    )
    render = chat_template.check(tok, Path("/m"))
    assert chat_template.turn_end(render) == expected


def _jinja(template: str, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    import jinja2

    return jinja2.Template(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


# ------------------------------------------------------------------ warm-up, VRAM, rebuild


def test_warmup_runs_a_job_through_the_generator(tmp_path: Path, fake_exl3: list[str]) -> None:
    # Model.warmup skips MTP drafters (model/model.py:259-260): the generator's own pass warms them.
    d = _model_dir(tmp_path, "mtp-model", fake_mtp=True)
    handle = loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=d, draft_mode=DraftMode.MTP))
    g = handle.generator
    assert isinstance(g, fx.Generator)
    assert g.job_serial == 1 and g.iterations > 0 and g.num_remaining_jobs() == 0
    assert handle.warmup_s > 0
    cold = loader.load_engine(
        WorkerSettings(backend="exllamav3", model_dir=_model_dir(tmp_path, "m"), warmup=False)
    )
    assert isinstance(cold.generator, fx.Generator) and cold.generator.job_serial == 0


def test_a_cache_larger_than_free_vram_is_warned_about(
    tmp_path: Path, fake_exl3: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    # 1M-token context, 32 layers of 8 KV heads of 128: an FP16 cache of 128 GiB by default
    d = _model_dir(
        tmp_path,
        "long",
        max_position_embeddings=1 << 20,
        num_hidden_layers=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    (d / "model.safetensors").write_bytes(b"\0" * 1024)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.load_engine(WorkerSettings(backend="exllamav3", model_dir=d, warmup=False))
    (rec,) = [r for r in caplog.records if "free VRAM" in r.getMessage()]
    msg = rec.getMessage()
    assert "no --cache-size" in msg and "128.0 GiB" in msg and "80.0 GiB of free VRAM" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.load_engine(
            WorkerSettings(backend="exllamav3", model_dir=d, cache_size=65536, cache_mode="4,4", warmup=False)
        )
    assert not [r for r in caplog.records if "free VRAM" in r.getMessage()]


def test_quantized_cache_size_follows_its_bits() -> None:
    fp16 = fx._CacheLayerSize(256, 8, 128, None).storage_size()
    q44 = fx._CacheLayerSize(256, 8, 128, (4, 4)).storage_size()
    assert fp16 == 2 * 256 * 1024 * 2
    assert q44 == 256 * 32 * (4 * 4 + 4 * 4 + 4)  # ints of k and v, an fp16 scale each per 32 channels
    assert not loader.warn_if_cache_exceeds_vram(None, 1, 0, 256, defaulted=True)


def test_the_handle_rebuilds_its_generator_over_the_same_cache(tmp_path: Path, fake_exl3: list[str]) -> None:
    handle = loader.load_engine(
        WorkerSettings(backend="exllamav3", model_dir=_model_dir(tmp_path, "m"), warmup=False)
    )
    old = handle.generator
    assert handle.rebuild_generator is not None and handle.check_device is not None
    new = handle.rebuild_generator()
    assert isinstance(old, fx.Generator) and isinstance(new, fx.Generator)
    assert old.closed and new is not old and new.cache is old.cache
    with pytest.raises(RuntimeError, match="no longer owns its Cache"):
        old.iterate()
    handle.check_device()  # no CUDA device here: nothing to probe
    handle.close()
    assert new.closed


def _sizes(mpe: int, caps: dict[str, Any], drafter: dict[str, Any] | None, **cfg: Any) -> loader.Sizes:
    config = WorkerSettings(backend="exllamav3", model_dir=Path("/m"), **cfg)
    text = loader.Text(SimpleNamespace(max_position_embeddings=mpe), None, None, (), ())
    draft = None if drafter is None else SimpleNamespace(caps=drafter)
    return loader.plan_sizes(config, text, loader.Models(SimpleNamespace(caps=caps), draft, ""))


@pytest.mark.parametrize(
    ("mpe", "caps", "drafter", "cfg", "expected"),
    [
        # (max_seq_len, max_batch_size, draft_tokens, cache_size): the model's context, 32
        # sequences, a window of 4 for n-gram, and a cache of the context + 1 + 4 in pages
        (2048, {}, None, {"draft_mode": "ngram"}, (2048, 32, 4, 2304)),
        (2048, {"recurrent_states": True}, None, {}, (2048, 4, 0, 2304)),
        (2048, {}, {"default_draft_size": 6}, {"draft_mode": "mtp"}, (2048, 32, 6, 2304)),
        (2048, {}, {}, {"draft_mode": "mtp"}, (2048, 32, 4, 2304)),
        (
            2048,
            {},
            {"default_draft_size": 6},
            {"draft_mode": "mtp", "num_draft_tokens": 2},
            (2048, 32, 2, 2304),
        ),
        (2048, {}, None, {"num_draft_tokens": 3}, (2048, 32, 0, 2304)),  # not drafting: no window
        (8192, {}, None, {"cache_size": 4096}, (4096, 32, 0, 4096)),
        (8192, {}, None, {"cache_size": 4096, "max_seq_len": 6000, "max_batch_size": 7}, (6000, 7, 0, 4096)),
        (0, {}, None, {}, (4096, 32, 0, 4352)),  # no context in the config
        (0, {}, None, {"cache_size": 1024}, (1024, 32, 0, 1024)),
    ],
)
def test_unset_sizes_are_resolved_for_the_model(
    mpe: int,
    caps: dict[str, Any],
    drafter: dict[str, Any] | None,
    cfg: dict[str, Any],
    expected: tuple[int, int, int, int],
) -> None:
    s = _sizes(mpe, caps, drafter, **cfg)
    assert (s.max_seq_len, s.max_batch_size, s.draft_tokens, s.cache_size) == expected
    assert s.max_position_embeddings == mpe


def test_the_load_reports_its_stages_with_module_progress(
    tmp_path: Path, fake_exl3: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from engine_worker.load_stages import LoadReporter, LoadStatus, Stage

    heard: list[LoadStatus] = []
    cfg = WorkerSettings(backend="exllamav3", model_dir=_model_dir(tmp_path, "m"))
    with caplog.at_level(logging.INFO, logger="engine_worker.load"):
        loader.build_backend(cfg, LoadReporter(heard.append, every=0.0))
    stages = [h.stage for h in heard]
    order = [Stage.IMPORT, Stage.LOAD_WEIGHTS, Stage.WARM_UP]
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == order
    weights = [h for h in heard if h.label.startswith("loading m")]
    assert weights and weights[-1].total > 0 and weights[-1].done == weights[-1].total
