"""The wheel's ``exllamav3/model/config.py`` (``Config``) and ``exllamav3/model/model.py``
(``Model``, its loading as in ``model/model_ls.py``), with a scripted "network": a
``Script`` picks each next token (``reply``, ``by_prompt``) and ``raw_probs`` is its output
distribution."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .tokenizer import EOS, IM_END, VOCAB_SIZE, Tokenizer

if TYPE_CHECKING:
    from .cache import Cache


Script = Callable[[Sequence[int], Sequence[int]], int]
"""``(prompt_ids, generated_ids) -> next token id``: the fake model's greedy choice.
``prompt_ids`` is the prompt of the client's request (not of a requeued segment)."""


def reply(text: str | bytes | Sequence[int], then: int = IM_END) -> Script:
    """Answer every prompt with ``text`` (UTF-8 bytes or ids), then ``then`` forever."""
    ids = list(text.encode("utf-8") if isinstance(text, str) else text)

    def script(prompt: Sequence[int], generated: Sequence[int]) -> int:
        n = len(generated)
        return ids[n] if n < len(ids) else then

    return script


def by_prompt(default: Script, **scripts: Script) -> Script:
    """Use ``scripts[key]`` when ``key`` occurs in the decoded prompt, else ``default``."""

    def script(prompt: Sequence[int], generated: Sequence[int]) -> int:
        text = Tokenizer._decode(list(prompt), True)
        for key, s in scripts.items():
            if key in text:
                return s(prompt, generated)
        return default(prompt, generated)

    return script


class Config:
    """``Config.from_directory`` (``model/config.py:259``): reads ``config.json``.

    Fake-only keys: ``"fake_mtp": true`` gives the model an MTP component. A
    ``"vision_config"`` (as Qwen2.5-VL's, Gemma 3's and Mistral 3's configs have) gives it a
    vision component (``VisionModel``), as the vision architectures register one
    (``architecture/qwen2_5_vl.py:42``); ``vision_start_token_id``/``vision_end_token_id``
    (Qwen's names) default to the bytes ``[`` and ``]``, the fake vocabulary having no
    image tokens."""

    def __init__(self, directory: str, config_dict: dict[str, Any]) -> None:
        self.directory = directory
        self.config_dict = config_dict
        self.architecture = config_dict["architectures"][0]
        self.max_position_embeddings = int(config_dict.get("max_position_embeddings", 8192))
        eos = config_dict.get("eos_token_id", EOS)
        self.eos_token_id_list = list(eos) if isinstance(eos, list) else [eos]
        self.eos_token_id = self.eos_token_id_list[0]
        self.vocab_size = int(config_dict.get("vocab_size", VOCAB_SIZE))
        self.model_classes: dict[str, type[Model]] = {"text": Model}
        if config_dict.get("fake_mtp"):
            self.model_classes["mtp"] = Model
        if "vision_config" in config_dict:
            self.model_classes["vision"] = VisionModel
        self.vision_start_token_id = int(config_dict.get("vision_start_token_id", ord("[")))
        self.vision_end_token_id = int(config_dict.get("vision_end_token_id", ord("]")))
        self.hidden_size = int(config_dict.get("hidden_size", 64))
        self.dynamic_seq_len: int | None = None
        self.script: Script | None = None

    @staticmethod
    def from_directory(directory: str) -> Config:
        with open(os.path.join(directory, "config.json"), encoding="utf8") as f:
            d = json.load(f)
        assert "architectures" in d, f"No architecture defined in {directory}/config.json"
        return Config(directory, d)

    def override_dynamic_seq_len(self, new_max_position_embeddings: int) -> None:
        self.dynamic_seq_len = new_max_position_embeddings


DEFAULT_SCRIPT = reply("Hello from the fake model.")

RAW_LOGIT_FIRST = 8.0
RAW_LOGIT_SECOND = 6.0


def raw_probs(choice: int) -> list[float]:
    """The fake model's output distribution over ids ``0 .. VOCAB_SIZE - 1`` when its script
    chooses ``choice``: logit ``RAW_LOGIT_FIRST`` for ``choice``, ``RAW_LOGIT_SECOND`` for
    ``(choice + 1) % VOCAB_SIZE``, 0 for every other id; the padded ids past the vocabulary get
    ``-inf`` (``sampler/custom.py:1206-1207``). Softmax at temperature 1, as
    ``Job.receive_logits`` computes ``token_probs``/``top_k_probs`` (``job.py:767-776``)."""
    logits = [0.0] * VOCAB_SIZE
    logits[choice] = RAW_LOGIT_FIRST
    logits[(choice + 1) % VOCAB_SIZE] = max(logits[(choice + 1) % VOCAB_SIZE], RAW_LOGIT_SECOND)
    peak = max(logits)
    weights = [math.exp(x - peak) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def top_k(probs: Sequence[float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(id, prob)``, most likely first; ties in id order (``torch.sort``
    leaves their order unspecified)."""
    return sorted(enumerate(probs), key=lambda t: (-t[1], t[0]))[:k]


def _default_script() -> Script:
    """``DEFAULT_SCRIPT`` as the package holds it now: replacing
    ``tests.fakes.exllamav3.DEFAULT_SCRIPT`` (as ``tests/fakes/gpu_standin`` does) changes the
    script of the models made after, as it did when the fake was one module."""
    script: Script = getattr(sys.modules[__name__.rpartition(".")[0]], "DEFAULT_SCRIPT", DEFAULT_SCRIPT)
    return script


DOMINANT_BIAS = 1e4
"""A logit bias at least this large makes the fake model choose that token."""


class NonFiniteLogits(RuntimeError):
    """``generator/job.py:21``: NaN/Inf logits on a job's first sample."""


class Model:
    """A model whose next token is ``script(prompt, generated)``. ``fail_prefill(prompt)``
    returning True makes prefill raise for that job (to produce ``"error"`` results);
    ``nonfinite(prompt)`` returning True makes that job's first sample raise
    ``NonFiniteLogits`` out of ``iterate()`` (``job.py:742-750``: ``receive_logits`` is
    called from the batched decode, which does not contain it). ``device_error``, once set,
    stands for a sticky CUDA error: every later GPU call raises it (``iterate`` here, and
    ``make_handle``'s ``check_device``)."""

    warmup_failures: tuple[str, ...] = ()
    """What ``warmup`` returns: labels of passes that raised (tests set it)."""

    def __init__(
        self,
        config: Config | None = None,
        component: str = "text",
        script: Script | None = None,
        fail_prefill: Callable[[Sequence[int]], bool] | None = None,
    ) -> None:
        self.config = config
        self.component = component
        self.script: Script = script or (config.script if config and config.script else _default_script())
        self.fail_prefill = fail_prefill
        self.nonfinite: Callable[[Sequence[int]], bool] | None = None
        self.device_error: Exception | None = None
        self.caps: dict[str, Any] = {}
        if component == "mtp":
            self.caps.update({"mtp_draft": True, "default_draft_size": 2})
        self.caches: list[Cache] = []
        self.loaded = False
        self.load_calls: list[dict[str, Any]] = []
        self.warmup_calls: list[dict[str, Any]] = []

    @staticmethod
    def from_config(config: Config, component: str = "text") -> Model:
        # model/model.py:186-190: the component's class from the config's map
        assert component in config.model_classes, (
            f"{config.architecture} does not define a '{component}' component model"
        )
        return config.model_classes[component](config, component)

    def load_gen(
        self,
        device: Any = None,
        tp_output_device: Any = None,
        reserve_per_device: list[float] | float | None = None,
        use_per_device: list[float] | float | None = None,
        tensor_p: bool = False,
        progressbar: bool = False,
        max_chunk_size: int = 2048,
        max_output_size: int = 32,
        max_output_factor: int = 1,
        callback: Callable[[int, int], None] | None = None,
        generator: bool = True,
        tp_dev_limits: dict[str, int] | None = None,
        tp_backend: str = "native",
        verbose: bool = False,
        max_batch_size: int = 1,
        tp_options: dict[str, Any] | None = None,
        autosplit_no_forward: bool = False,
        draft_model: Model | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Yields ``(modules_done, modules_total)`` like ``model/model_ls.py:140,318``."""
        self.load_calls.append(
            {
                "use_per_device": use_per_device,
                "tensor_p": tensor_p,
                "tp_backend": tp_backend,
                "max_chunk_size": max_chunk_size,
                "draft_model": draft_model,
                "caches_attached": len(self.caches),
            }
        )
        n = 5
        for i in range(n):
            yield i, n
        self.loaded = True
        for c in self.caches:
            c.initialized = True
        yield n, n

    def load(self, **kwargs: Any) -> None:
        kwargs["generator"] = False
        for _ in self.load_gen(**kwargs):
            pass

    def warmup(
        self,
        cache: Cache | None = None,
        max_chunk_size: int = 2048,
        max_batch_size: int = 8,
        max_q_len: int = 16,
        long_context: bool = True,
        progressbar: bool = False,
        callback: Callable[[int, int], None] | None = None,
        verbose: bool = False,
    ) -> list[str]:
        assert self.loaded, "warmup before load"
        assert cache is None or cache.owner is None, "warmup must run before a Generator owns the cache"
        self.warmup_calls.append({"cache": cache, "max_chunk_size": max_chunk_size})
        # Labels of the passes that raised (model/model.py:252-253); set by tests.
        return list(self.warmup_failures)

    def unload(self) -> None:
        self.loaded = False
        for c in self.caches:
            c.initialized = False


VISION_PATCH = 28
"""The fake vision component's rule: one embedding row per 28 x 28 pixels (rounded up), as
Qwen2.5-VL's 14-pixel patches merged 2 x 2 give."""


def image_rows(width: int, height: int) -> int:
    """Rows (image tokens) the fake vision component gives an image of this size."""
    return max(1, -(-width // VISION_PATCH)) * max(1, -(-height // VISION_PATCH))


class VisionModel(Model):
    """A vision component (``Model.from_config(config, component="vision")``, as
    ``Qwen3VLVisionModel``, ``architecture/qwen3_vl.py:154``): ``get_image_embeddings`` with
    1.6.5's signature (``qwen3_vl.py:368-373``) returns an ``MMEmbedding`` whose
    ``token_string`` is the start token, ``image_rows`` placeholders and the end token
    (``qwen3_vl.py:405-407``). ``embedded`` lists each call's ``(width, height)``;
    ``fail(image)`` returning True makes a call raise (``RuntimeError``)."""

    def __init__(self, config: Config | None = None, component: str = "vision", **kwargs: Any) -> None:
        super().__init__(config, component, **kwargs)
        self.embedded: list[tuple[int, int]] = []
        self.fail: Callable[[Any], bool] | None = None

    def get_image_embeddings(self, tokenizer: Any, image: Any, text_alias: str | None = None) -> Any:
        from .mm_embedding import MMEmbedding, Rows

        assert self.loaded, "the vision component is not loaded"
        assert not isinstance(image, list), "a list of images is a video batch: not modelled"
        if self.fail is not None and self.fail(image):
            raise RuntimeError("vision forward pass failed (fake)")
        width, height = image.size
        self.embedded.append((width, height))
        start = self.config.vision_start_token_id if self.config else ord("[")
        end = self.config.vision_end_token_id if self.config else ord("]")
        hidden = self.config.hidden_size if self.config else 64
        rows = image_rows(width, height)
        embedding = MMEmbedding(Rows(rows, hidden), [start, *([-1] * rows), end], text_alias)
        embedding.metadata.update({"original_size": image.size})
        return embedding
