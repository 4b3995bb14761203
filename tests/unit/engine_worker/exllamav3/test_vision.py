"""Images on ExLlamaV3's vision models, through the fake 1.6.5 generator and its vision
component (``tests/fakes/exllamav3``: ``VisionModel``, ``MMEmbedding``): where an image's ids
go in the prompt, the embeddings a job gets, the reuse of a repeated image (embedding and
prefix cache), the KV-cache events of pages that hold images, and the loader."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from engine_worker.backend import RequestRejected
from engine_worker.exllamav3 import loader
from engine_worker.exllamav3.vision import FIRST_EMBEDDING_ID, GpuTurns, ImageEmbeddings, Vision
from engine_worker.settings import WorkerSettings
from protocol.messages import ChatMessage, ErrorCode, ImageInput, SamplingParams, Submit
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import add, chat, finished, make_backend, progress, run, text_of
from tests.unit.engine_worker.exllamav3.test_kv_pages import Sink, page_hash


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def with_image(
    rid: str, before: str, data: bytes, after: str, *history: ChatMessage, **params: Any
) -> Submit:
    """A chat request whose last user turn is ``before``, an image, ``after``: content parts
    joined with newlines, the image an empty part (``protocol.messages.ImageInput``)."""
    content = f"{before}\n\n{after}"
    image = ImageInput(data, len(before) + 1, f"messages[{len(history)}].content[1]")
    params.setdefault("max_tokens", 8)
    turn = ChatMessage("user", content, images=(image,))
    return Submit(rid, SamplingParams(**params), messages=(*history, turn))


def chatml_ids(text: str) -> list[int]:
    """The fake tokenizer's ids of rendered ChatML text (control tokens as their ids)."""
    return fx.Tokenizer().encode(text, encode_special_tokens=True).tolist()[0]


def image_ids(ids: list[int]) -> list[int]:
    return [i for i in ids if i >= FIRST_EMBEDDING_ID]


def vision_backend(**kwargs: Any) -> tuple[Any, Any]:
    config = kwargs.pop("config", None)
    backend, rec = make_backend(config, vision=True, **kwargs)
    return backend, rec


def test_a_model_with_a_vision_component_takes_images() -> None:
    backend, _ = vision_backend()
    assert backend.info.vision
    text_only, _ = make_backend()
    assert not text_only.info.vision


def test_an_image_is_its_embedding_between_the_texts_around_it() -> None:
    backend, _ = vision_backend(script=fx.reply("ok"))
    data = png(64, 40)  # ceil(64/28) * ceil(40/28) = 3 * 2 = 6 rows
    prepared = backend.prepare(with_image("a", "Look:", data, "What is it?"))
    ids = backend.prompt_ids(prepared)
    head = chatml_ids("<|im_start|>user\nLook:\n")
    tail = chatml_ids("\nWhat is it?<|im_end|>\n<|im_start|>assistant\n")
    rows = fx.image_rows(64, 40)
    assert rows == 6
    assert ids[: len(head)] == head and ids[len(ids) - len(tail) :] == tail
    middle = ids[len(head) : len(ids) - len(tail)]
    # The fake vision component's start and end tokens around 6 fresh, consecutive ids.
    assert middle[0] == ord("[") and middle[-1] == ord("]")
    first = middle[1]
    assert first >= FIRST_EMBEDDING_ID and middle[1:-1] == list(range(first, first + rows))
    assert prepared.prompt_tokens == len(head) + rows + 2 + len(tail)


def test_the_job_gets_each_embedding_once_and_runs_to_the_end() -> None:
    backend, rec = vision_backend(script=fx.reply("seen"))
    data = png(30, 30)
    history = (
        ChatMessage("user", "\nfirst", images=(ImageInput(data, 0, "messages[0].content[0]"),)),
        ChatMessage("assistant", "noted"),
    )
    submit = with_image("a", "again:", data, "same?", *history)
    add(backend, submit)
    job = rec.inner.pending_jobs[-1]
    ids = job.input_ids
    found = image_ids(ids)
    assert len(found) == 2 * fx.image_rows(30, 30) and found[:4] == found[4:]  # one image, twice
    assert len(job.embeddings) == 1 and job.embeddings[0].first_index == found[0]
    events = run(backend)
    assert text_of(events, "a") == "seen"
    f = finished(events, "a")
    assert f.prompt_tokens == len(ids)
    # Progress counts the image's tokens like any other prompt token.
    assert progress(events, "a")[-1] == len(ids)


def test_a_repeated_image_reuses_its_embedding_and_the_prefix_cache() -> None:
    backend, rec = vision_backend(script=fx.reply("fine"))
    vision = fx.vision_model(backend._h)
    data = png(56, 56)
    add(backend, with_image("a", "Describe:", data, "briefly"))
    first_ids = list(rec.inner.pending_jobs[-1].input_ids)
    run(backend)
    # The next turn of the same conversation: the first turn again, the answer, a question.
    again = with_image("b", "Describe:", data, "briefly").messages[0]
    follow = Submit(
        "b",
        SamplingParams(max_tokens=4),
        messages=(again, ChatMessage("assistant", "fine"), ChatMessage("user", "more?")),
    )
    add(backend, follow)
    second_ids = list(rec.inner.pending_jobs[-1].input_ids)
    events = run(backend)
    assert vision.embedded == [(56, 56)]  # embedded once, found the second time
    assert image_ids(second_ids) == image_ids(first_ids)
    # The first prompt and its answer are where the second starts: all of it is found.
    held = [*first_ids, *b"fine"]
    assert second_ids[: len(held)] == held
    assert finished(events, "b").cached_tokens == len(held)


def test_another_image_gets_other_ids_and_misses_from_where_it_starts() -> None:
    backend, rec = vision_backend(script=fx.reply("x"))
    add(backend, with_image("a", "See", png(28, 28), "now"))
    a = list(rec.inner.pending_jobs[-1].input_ids)
    run(backend)
    add(backend, with_image("b", "See", png(28, 28, (0, 0, 255)), "now"))
    b = list(rec.inner.pending_jobs[-1].input_ids)
    events = run(backend)
    assert image_ids(a) != image_ids(b) and len(image_ids(a)) == len(image_ids(b)) == 1
    before_image = a.index(image_ids(a)[0])
    # The start token is shared; the cache hit ends where the ids differ.
    assert finished(events, "b").cached_tokens == before_image


def test_client_text_never_stands_for_an_image() -> None:
    backend, _ = vision_backend()
    prepared = backend.prepare(with_image("a", "x", png(28, 28), "y"))
    first = image_ids(backend.prompt_ids(prepared))[0]
    # 1.6.5's text alias of that embedding, typed by a client, is text.
    alias = f"<$EMB_{first}$>"
    ids = backend.prompt_ids(backend.prepare(chat("b", f"{alias} and {alias}")))
    assert image_ids(ids) == []
    assert fx.Tokenizer._decode(ids, True).count(alias) == 2


def test_the_image_cache_is_bounded_in_bytes() -> None:
    # 64 hidden x 2 bytes = 128 bytes a row: 1 row an image of up to 28 x 28 pixels.
    small = ImageEmbeddings(_vision(), GpuTurns(), max_bytes=2 * 128)
    images = [ImageInput(png(28, 28, (k, 0, 0)), 0, f"p{k}") for k in range(3)]
    for image in images:
        small.embedding(image)
    assert len(small) == 2 and small.kept_bytes == 256 and small.embedded == 3
    small.embedding(images[2])  # kept
    small.embedding(images[0])  # dropped first: embedded again
    assert small.hits == 1 and small.embedded == 4
    none = ImageEmbeddings(_vision(), GpuTurns(), 0)
    none.embedding(images[0])
    none.embedding(images[0])
    assert none.embedded == 2 and len(none) == 0


def _vision() -> Vision:
    return Vision(loader.LoadedEngine.open_image, _embedder(), loader.LoadedEngine.embedding_bytes)


def _embedder() -> Any:
    model = fx.VisionModel()
    model.load()
    tok = fx.Tokenizer()
    return lambda image: model.get_image_embeddings(tokenizer=tok, image=image)


def test_an_image_the_model_cannot_read_is_refused_naming_its_part() -> None:
    backend, _ = vision_backend()
    vision = fx.vision_model(backend._h)
    vision.fail = lambda image: image.size == (29, 29)
    with pytest.raises(RequestRejected) as e:
        backend.prepare(with_image("a", "x", png(29, 29), "y"))
    assert e.value.code is ErrorCode.INVALID_REQUEST and e.value.param == "messages[0].content[1]"
    assert "vision component failed" in e.value.message
    vision.fail = None
    real = vision.get_image_embeddings

    def oom(tokenizer: Any, image: Any, text_alias: str | None = None) -> Any:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    vision.get_image_embeddings = oom  # type: ignore[method-assign]
    with pytest.raises(RequestRejected) as e:
        backend.prepare(with_image("c", "x", png(30, 30), "y"))
    assert e.value.code is ErrorCode.OVERLOADED and e.value.param == "messages[0].content[1]"
    vision.get_image_embeddings = real  # type: ignore[method-assign]
    with pytest.raises(RequestRejected) as e:
        backend.prepare(with_image("b", "x", b"GIF89a not really", "y"))
    assert e.value.param == "messages[0].content[1]" and "cannot be read" in e.value.message


def test_a_template_that_drops_an_image_is_refused() -> None:
    last_only = (
        "{% for m in messages[-1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    backend, _ = vision_backend(chat_template=last_only)
    history = (ChatMessage("user", "\nold", images=(ImageInput(png(28, 28), 0, "messages[0].content[0]"),)),)
    last = ChatMessage("user", "\nnew", images=(ImageInput(png(56, 28), 0, "messages[1].content[0]"),))
    submit = Submit("a", SamplingParams(max_tokens=4), messages=(*history, last))
    with pytest.raises(RequestRejected) as e:
        backend.prepare(submit)
    # the image the template left out is named, not the one it kept
    assert e.value.param == "messages[0].content[0]" and "dropped or repeated an image" in e.value.message


def test_a_requeued_job_keeps_its_embeddings() -> None:
    config = WorkerSettings(backend="exllamav3", model_dir=Path("/models/fake"), max_rq_tokens=256)
    backend, rec = vision_backend(config=config, script=fx.reply("y" * 600))
    add(backend, with_image("a", "long", png(28, 28), "answer", max_tokens=600, ignore_eos=True))
    events = run(backend)
    assert any(r.get("requeue") for r in rec.results)
    assert finished(events, "a").completion_tokens == 600


def test_pages_holding_image_ids_are_not_published() -> None:
    backend, rec = vision_backend(script=fx.reply("z"), max_chunk_size=256)
    sink = Sink()
    events = backend.attach_kv_events(sink)
    text = "".join(chr(0x61 + i % 26) for i in range(300))
    add(backend, with_image("a", text, png(28, 28), text))
    ids = list(rec.inner.pending_jobs[-1].input_ids)
    run(backend)
    events.flush()
    assert image_ids(ids) and ids.index(image_ids(ids)[0]) > 256  # the image is in page 1
    stored = [e for e in sink.events if isinstance(e, fx_vllm().BlockStored)]
    # Page 0 (text only) is published, pages 1 and 2 (the image, and text after it) are not.
    assert [e.block_hashes for e in stored] == [[page_hash(None, ids[:256])]]
    assert all(t < FIRST_EMBEDDING_ID for e in stored for t in e.token_ids)


def fx_vllm() -> Any:
    from tests.fakes import kv_subscriber

    return kv_subscriber


def test_gpu_turns_serve_in_arrival_order_and_keep_steps_out() -> None:
    turns = GpuTurns()
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def embed() -> None:
        with turns:
            order.append("embed in")
            inside.set()
            release.wait(5)
            order.append("embed out")

    t = threading.Thread(target=embed)
    t.start()
    inside.wait(5)

    def step() -> None:
        with turns:
            order.append("step")

    s = threading.Thread(target=step)
    s.start()
    time.sleep(0.05)
    assert order == ["embed in"]  # the step waits for the embedding in its turn
    release.set()
    t.join(5)
    s.join(5)
    assert order == ["embed in", "embed out", "step"]


def test_a_step_waits_for_an_embedding_in_progress() -> None:
    backend, rec = vision_backend(script=fx.reply("ok"))
    vision = fx.vision_model(backend._h)
    started, release = threading.Event(), threading.Event()
    real = vision.get_image_embeddings

    def slow(tokenizer: Any, image: Any, text_alias: str | None = None) -> Any:
        started.set()
        release.wait(5)
        return real(tokenizer, image, text_alias)

    vision.get_image_embeddings = slow  # type: ignore[method-assign]
    prep = threading.Thread(target=lambda: backend.prepare(with_image("i", "a", png(28, 28), "b")))
    prep.start()
    started.wait(5)
    iterated = len(rec.results)
    added = threading.Event()

    def add_and_step() -> None:  # the loop thread: enqueue and iterate on one thread
        add(backend, chat("t", "text only"))
        added.set()
        backend.step()

    stepper = threading.Thread(target=add_and_step)
    stepper.start()
    added.wait(5)
    time.sleep(0.05)
    assert stepper.is_alive() and len(rec.results) == iterated  # held at the GPU turn
    release.set()
    prep.join(5)
    stepper.join(5)
    assert not stepper.is_alive() and len(rec.results) > iterated


# ---------------------------------------------------------------- the loader


def _vision_model_dir(root: Path, **extra: Any) -> Path:
    d = root / "vl"
    d.mkdir()
    cfg = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "max_position_embeddings": 2048,
        "eos_token_id": [257, 259],
        "vision_config": {"patch_size": 14},
        **extra,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    fx.write_hf_tokenizer(str(d), fx.CHATML_TEMPLATE)
    return d


@pytest.fixture
def fake_exl3(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "exllamav3", fx)
    for name in (
        "exllamav3.generator",
        "exllamav3.generator.filter",
        "exllamav3.generator.filter.llguidance",
    ):
        monkeypatch.setitem(sys.modules, name, fx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(loader, "_free_vram_bytes", lambda split: 80 * loader.GIB)
    order: list[str] = []
    real = fx.Model.load_gen

    def load_gen(self: fx.Model, **kw: Any) -> Any:
        order.append(self.component)
        return real(self, **kw)

    monkeypatch.setattr(fx.Model, "load_gen", load_gen)
    return order


def test_the_loader_loads_the_vision_component_first_and_serves_images(
    tmp_path: Path, fake_exl3: list[str]
) -> None:
    d = _vision_model_dir(tmp_path)
    backend = loader.build_backend(WorkerSettings(backend="exllamav3", model_dir=d, warmup=False))
    assert fake_exl3 == ["vision", "text"] and backend.info.vision
    add(backend, with_image("a", "What?", png(60, 30), ""))
    events = run(backend)
    # 3 x 2 rows, the start and end tokens, and the text around them.
    text = chatml_ids("<|im_start|>user\nWhat?\n\n<|im_end|>\n<|im_start|>assistant\n")
    assert finished(events, "a").prompt_tokens == len(text) + 6 + 2
    backend.close()


def test_no_vision_leaves_the_component_unloaded(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = _vision_model_dir(tmp_path)
    backend = loader.build_backend(
        WorkerSettings(backend="exllamav3", model_dir=d, warmup=False, vision=False)
    )
    assert fake_exl3 == ["text"] and not backend.info.vision


def test_a_text_model_has_no_vision(tmp_path: Path, fake_exl3: list[str]) -> None:
    d = tmp_path / "plain"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": [257]}))
    fx.write_hf_tokenizer(str(d), fx.CHATML_TEMPLATE)
    backend = loader.build_backend(WorkerSettings(backend="exllamav3", model_dir=d, warmup=False))
    assert fake_exl3 == ["text"] and not backend.info.vision


def test_embedding_bytes_count_every_tensor() -> None:
    e = _embedder()(Image.new("RGB", (56, 28)))
    assert loader.LoadedEngine.embedding_bytes(e) == 2 * 64 * 2  # 2 rows of 64 halves
