"""The worker's settings: every option of ``python -m engine_worker`` written once.

``WorkerSettings`` is the one source of each option's name, type, default,
range, environment variable and help; ``protocol.settings`` derives the CLI from
it, and the backends read it directly, so one concept has one name everywhere
(flag ``--chunk-size``, variable ``EXL3_SIDECAR_CHUNK_SIZE``, field
``chunk_size``). Names follow TabbyAPI's ``config.yml`` where one exists
(``max_seq_len``, ``cache_size``, ``cache_mode``, ``chunk_size``,
``max_batch_size``, ``gpu_split``, ``tensor_parallel``, ``draft_model_dir``,
``output_chunking``, ...). Options marked ``[cpu]`` or ``[exllamav3]`` apply to
that backend only.

A few defaults depend on the backend; they are resolved once, when the object is
built (``BACKEND_DEFAULTS``), so a backend never sees ``None`` for them.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path
from typing import Any, Literal

from engine_worker.options.exllamav3 import (
    EXLLAMAV3_DRAFT_TOKENS,
    EXLLAMAV3_MAX_BATCH_SIZE,
    EXLLAMAV3_MAX_BATCH_SIZE_RECURRENT,
)
from engine_worker.options.exllamav3 import validate as validate_exllamav3
from engine_worker.options.paths import check_gpu_layers, check_worker_paths
from protocol.endpoints import LinkSettings
from protocol.settings import setting

BackendName = Literal["cpu", "exllamav3", "synthetic"]
Dtype = Literal["float32", "bfloat16", "float16"]
QuantizationName = Literal["int4", "int8", "none"]
ReasoningParserName = Literal["auto", "none", "deepseek_r1", "qwen3", "gpt_oss", "mistral"]
"""``engine_worker.reasoning.ParserName``, written here so settings import nothing heavy."""


class DraftMode(enum.StrEnum):
    """Speculative decoding mode; the values are the ``drafting`` names of ``protocol.messages.Ready``."""

    NONE = "none"
    NGRAM = "ngram"  # prompt lookup: continue an earlier occurrence of the current suffix
    DRAFT_MODEL = "draft_model"  # exllamav3: a separate, smaller EXL3 model with the same vocabulary
    MTP = "mtp"  # exllamav3: the model's own multi-token-prediction head


CPU_KERNELS: dict[str, tuple[str, ...]] = {
    "head": ("int_mm", "vnni", "onednn"),
    "layers": ("vnni", "torch"),
    "attention": ("llvm", "sdpa"),
}
"""``--cpu-kernels``' vocabulary: each product the CPU engine can run more than one
way and its kernels (``engine_worker.cpu.kernel_choice.CANDIDATES``, written here so
settings import nothing heavy; a test keeps the two equal)."""


def parse_cpu_kernels(text: str) -> dict[str, str]:
    """``--cpu-kernels`` (``head=int_mm,layers=torch``, any subset of ``CPU_KERNELS``)
    as ``{role: kernel}``. Raises ``ValueError`` naming the option."""
    chosen: dict[str, str] = {}
    for part in text.split(","):
        role, sep, name = (p.strip() for p in part.partition("="))
        if not sep or role not in CPU_KERNELS or name not in CPU_KERNELS[role] or role in chosen:
            raise ValueError(
                f"--cpu-kernels {text!r}: expected role=kernel pairs, each role once, from "
                + "; ".join(f"{r}={'|'.join(k)}" for r, k in CPU_KERNELS.items())
            )
        chosen[role] = name
    return chosen


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/exl3-sidecar``, or ``~/.cache/exl3-sidecar``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exl3-sidecar"


BACKEND_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"max_seq_len": 8192, "chunk_size": 256, "num_draft_tokens": 4, "max_batch_size": 16},
    # max_seq_len, num_draft_tokens, max_batch_size and cache_size depend on the model:
    # resolved by its loader (engine_worker.exllamav3.sizes).
    "exllamav3": {"chunk_size": 2048},
    "synthetic": {"max_seq_len": 8192, "chunk_size": 256, "max_batch_size": 1024},
}
"""Defaults of the options whose default depends on ``backend``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSettings(LinkSettings):
    """Everything the worker process needs, plus ``LinkSettings`` (the ZeroMQ
    addresses it binds, the log level). Token counts are tokens, times seconds,
    ExLlamaV3's "GB" are GiB (``model/model.py:651,662``).

    Raises ``ValueError`` naming the field for a value out of range or an option
    that does not fit the backend.
    """

    backend: BackendName = setting(
        "cpu",
        "Engine: the CPU engine (embedded SmolLM2-135M-Instruct by default), ExLlamaV3 on CUDA, or "
        "the model-less synthetic engine for load and fault tests.",
    )
    model_dir: Path | None = setting(
        None,
        "Model directory: EXL3 for exllamav3 (required), HF safetensors for cpu "
        "(default: the embedded model). Checked before anything loads: a GGUF file, a missing "
        "folder or one without config.json is a usage error.",
        aliases=("-m", "--model"),
    )
    max_seq_len: int | None = setting(
        None,
        "Context length in tokens, prompt + completion (default: cpu 8192, exllamav3 the model's, "
        "capped by --cache-size).",
        ge=2,
        aliases=("-c", "--ctx-size", "--max-model-len"),
    )
    chunk_size: int | None = setting(
        None,
        "Prefill chunk in tokens, one progress event each (default: cpu 256, exllamav3 2048; "
        "exllamav3 needs a multiple of 256).",
        ge=1,
    )
    draft_mode: DraftMode = setting(
        DraftMode.NONE,
        "Speculative decoding: n-gram prompt lookup (both backends), or (exllamav3) a draft model "
        "or the model's MTP head.",
    )
    num_draft_tokens: int | None = setting(
        None,
        "Draft length in tokens per verification (default: "
        f"cpu {BACKEND_DEFAULTS['cpu']['num_draft_tokens']}, exllamav3 the drafter's own, "
        f"{EXLLAMAV3_DRAFT_TOKENS} for ngram).",
        ge=1,
    )
    ngram_match_min: int = setting(
        2, "Shortest n-gram (tokens) that must match before n-gram drafting proposes tokens.", ge=1
    )
    heartbeat_interval: float = setting(1.0, "Seconds between worker heartbeats.", ge=0.05)
    max_batch_size: int | None = setting(
        None,
        "Most sequences running at once; more wait in the worker's queue (default: "
        f"cpu {BACKEND_DEFAULTS['cpu']['max_batch_size']}, exllamav3 {EXLLAMAV3_MAX_BATCH_SIZE}, "
        f"or {EXLLAMAV3_MAX_BATCH_SIZE_RECURRENT} with recurrent layers).",
        ge=1,
        aliases=("-np", "--parallel", "--max-num-seqs"),
    )
    max_queue: int = setting(
        256, "Most requests waiting for admission; beyond it requests get 429 queue_full.", ge=0
    )
    backfill_max_wait: float = setting(
        30.0,
        "Seconds the request at the head of the queue may be passed by later ones that fit the "
        "batch slots and KV budget left (backfilling: short requests keep moving while long "
        "reservations fill the budget); after that the queue is strict FIFO until the head "
        "starts, so it cannot starve. 0: strict FIFO.",
        ge=0,
    )
    parent_pid: int | None = setting(
        None, "Stop when the process with this pid is gone (serve passes its own); checked every heartbeat."
    )
    heartbeat_file: Path | None = setting(
        None,
        "Also write each heartbeat to this file (JSON, replaced atomically), for a liveness probe "
        "that needs no connection: python -m engine_worker.probe, serve's supervisor.",
    )
    kv_events_endpoint: str | None = setting(
        None,
        "Publish the prefix cache's KV-cache events (vLLM's format, for llm-d's precise prefix-cache "
        "scorer) on a ZeroMQ PUB socket at this address, e.g. tcp://*:5557: bound (subscribers dial "
        "it) where this host can bind it (a wildcard, localhost, one of its addresses, ipc://), else "
        "connected to (a subscriber there binds) (default: off).",
    )
    kv_events_connect: bool = setting(
        False,
        "Connect the KV-event PUB socket to --kv-events-endpoint even where this host could bind it: "
        "for a subscriber on this host that binds the address itself.",
    )
    kv_events_topic: str | None = setting(
        None,
        "Topic of the KV-cache events (default: kv@<pod>@<model>, the pod from $POD_IP, else the "
        "host name; the model the served model id).",
    )
    kv_events_replay_endpoint: str | None = setting(
        None,
        "ZeroMQ ROUTER address (bound) that replays buffered KV-event batches from a requested "
        "sequence number (default: none).",
    )
    # cpu engine
    cache_dir: Path = setting(
        default_factory=default_cache_dir,
        help="[cpu] Where the embedded model is converted once and quantized weights are kept between "
        "starts (default: $XDG_CACHE_HOME/exl3-sidecar).",
    )
    quantization: QuantizationName = setting(
        "int4",
        "[cpu] Weight-only quantization of the linear layers: int4 (groups of 32, the levels of the "
        "embedded Q4_1 GGUF), int8 (per channel), none (--dtype weights). The KV cache is float32.",
    )
    dtype: Dtype = setting("float32", "[cpu] Weights dtype with --quantization none.")
    dense_prefill: bool = setting(
        True,
        "[cpu] Keep bfloat16 copies of quantized weights for prompt chunks of 32+ tokens: about 1.7x "
        "faster prefill for 2 bytes per parameter more memory.",
    )
    cpu_kernels: str | None = setting(
        None,
        "[cpu] Force kernels instead of the start-up choice by measured speed, for diagnosis: "
        "head=int_mm|vnni|onednn, layers=vnni|torch, attention=llvm|sdpa, comma-separated, any subset "
        "(default: the fastest exact one of each, measured once per CPU and kept in --cache-dir).",
    )
    kv_cache_mb: int = setting(
        4096,
        "[cpu] Memory for the KV cache of running sequences, MiB; each reserves its prompt plus "
        "max_tokens (up to the context) when it is admitted.",
        ge=1,
    )
    prefix_cache_mb: int = setting(
        1024, "[cpu] Memory budget of the prefix cache (KV of earlier sequences), MiB; 0 disables it.", ge=0
    )
    threads: int | None = setting(
        None, "[cpu] torch intra-op threads (default: torch's choice).", ge=1, aliases=("-t",)
    )
    ngram_match_max: int | None = setting(
        None, "[cpu] Longest n-gram (tokens) looked up for drafting (default: max(4, ngram_match_min)).", ge=1
    )
    n_gpu_layers: str | None = setting(
        None,
        "llama.cpp's option, accepted where it means what this engine does: cpu and synthetic "
        "only 0 (no layer on a GPU); exllamav3 only all, auto or at least the model's layer count "
        "(every layer on a GPU: ExLlamaV3 has no partial offload; --gpu-split places them).",
        aliases=("-ngl", "--gpu-layers"),
    )
    # exllamav3
    cache_size: int | None = setting(
        None, "[exllamav3] KV cache size in tokens, a multiple of 256 (default: max-seq-len).", ge=256
    )
    cache_mode: str = setting(
        "FP16", "[exllamav3] KV cache precision: FP16, or k_bits,v_bits such as 8,8 or 4,4."
    )
    gpu_split: str | None = setting(
        None, "[exllamav3] GB of VRAM per GPU, comma-separated (default: autosplit)."
    )
    tensor_parallel: bool = setting(False, "[exllamav3] Load with tensor parallelism across GPUs.")
    tensor_parallel_backend: Literal["native", "nccl"] = setting(
        "native", "[exllamav3] Tensor-parallel transport."
    )
    draft_model_dir: Path | None = setting(
        None, "[exllamav3] Draft model (EXL3) for --draft-mode draft_model."
    )
    draft_cache_size: int | None = setting(
        None,
        "[exllamav3] Draft model KV cache size in tokens; must equal the main cache size (default: it).",
        ge=256,
    )
    draft_cache_mode: str = setting("FP16", "[exllamav3] Draft model KV cache precision, as --cache-mode.")
    draft_gpu_split: str | None = setting(
        None,
        "[exllamav3] GB of VRAM per GPU for the draft model, comma-separated (default: placed "
        "automatically, not with --gpu-split).",
    )
    output_chunking: bool = setting(
        True,
        "[exllamav3] Reserve cache pages for at most --max-rq-tokens completion tokens at a time; a "
        "longer completion is re-queued with its text so far as the prompt (a prefix-cache hit).",
    )
    max_rq_tokens: int = setting(
        2048, "[exllamav3] Completion tokens per job before it is re-queued (output chunking).", ge=1
    )
    warmup: bool = setting(True, "[exllamav3] Run one warm-up pass before serving.")
    vision: bool = setting(
        True,
        "[exllamav3] Load the model's vision component where it has one, so chat turns may hold "
        "images; --no-vision leaves it unloaded (its VRAM free) and images are refused.",
    )
    image_cache_mb: int = setting(
        1024,
        "[exllamav3] Host memory, MiB, for the embeddings of recent images, kept by the SHA-256 of "
        "their bytes so that an image sent again reuses its embedding and the prefix cache's pages.",
        ge=0,
    )
    add_bos: bool = setting(
        True, "[exllamav3] Prepend the tokenizer's BOS token to raw-text prompts (if the model uses one)."
    )
    trust_remote_code: bool = setting(
        False,
        "[exllamav3] Let transformers run Python code from the model directory to load the tokenizer "
        "that renders the chat template (AutoTokenizer trust_remote_code); only for directories you trust.",
    )
    max_engine_faults: int = setting(
        3,
        "[exllamav3] Engine faults (an exception out of a generator step: CUDA out of memory, non-finite "
        "logits, a CUDA error) within --engine-fault-window seconds at which the worker exits with status 3 "
        "to be restarted; each fault before that rebuilds the generator and fails only the requests that "
        "were in the faulted step.",
        ge=1,
    )
    engine_fault_window: float = setting(
        600.0, "[exllamav3] Seconds over which --max-engine-faults are counted.", gt=0
    )

    reasoning_parser: ReasoningParserName = setting(
        "auto",
        "How the model's thinking is told apart from its answer (vLLM's --reasoning-parser names): "
        "auto (from the chat template: a template that writes a <think>, [THINK] or Harmony analysis "
        "span whose markers are single tokens), none, deepseek_r1, qwen3, gpt_oss, mistral.",
    )
    reasoning_budget: int | None = setting(
        None,
        "Most tokens a reasoning model may think per request when the request sets no budget "
        "(thinking_budget_tokens); then the end of the span is written for it. 0: no thinking. "
        "Default: no limit.",
        ge=0,
    )

    # synthetic engine
    synthetic_step_ms: float = setting(20.0, "[synthetic] Milliseconds between engine steps.", ge=0)
    synthetic_tokens_per_step: int = setting(
        1, "[synthetic] Tokens each decoding sequence emits per step.", ge=1
    )
    synthetic_kv_tokens: int = setting(
        1 << 20, "[synthetic] KV capacity in tokens that admission budgets against.", ge=1
    )
    synthetic_image_tokens: int = setting(
        0,
        "[synthetic] Tokens each image of a chat turn takes (the model then takes images); 0: "
        "text only, images refused as on a model without vision.",
        ge=0,
    )
    synthetic_prefix_cache: bool = setting(
        False,
        "[synthetic] Count a prompt's longest common prefix with one of the last 64 prefilled "
        "prompts of its cache_salt as cached tokens (an image's tokens are its digest's), so the "
        "cached-token path runs without a model.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_gpu_layers is not None:
            check_gpu_layers(self.backend, self.n_gpu_layers)
        for name, value in BACKEND_DEFAULTS[self.backend].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.ngram_match_max is None:
            object.__setattr__(self, "ngram_match_max", max(4, self.ngram_match_min))
        object.__setattr__(self, "draft_mode", DraftMode(self.draft_mode))
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.draft_model_dir is not None:
            object.__setattr__(self, "draft_model_dir", Path(self.draft_model_dir))
        assert self.ngram_match_max is not None
        if self.ngram_match_max < self.ngram_match_min:
            raise ValueError(
                f"ngram_match_max={self.ngram_match_max} is below ngram_match_min={self.ngram_match_min}"
            )
        if self.cpu_kernels is not None:
            if self.backend != "cpu":
                raise ValueError(f"cpu_kernels: backend={self.backend} has no CPU kernels to choose")
            parse_cpu_kernels(self.cpu_kernels)
        if self.kv_events_endpoint is None:
            for name in ("kv_events_topic", "kv_events_replay_endpoint", "kv_events_connect"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"{name} needs kv_events_endpoint")
        elif self.backend == "synthetic":
            raise ValueError("kv_events_endpoint: the synthetic engine publishes no KV-cache events")
        if self.backend == "synthetic":
            if self.draft_mode is not DraftMode.NONE:
                raise ValueError("draft_mode: the synthetic engine does not draft")
        elif self.backend == "cpu":
            if self.draft_mode not in (DraftMode.NONE, DraftMode.NGRAM):
                raise ValueError(f"draft_mode={self.draft_mode.value} needs backend=exllamav3")
        else:
            validate_exllamav3(self)

    def check_paths(self) -> None:
        """The checks that read the disk, run by the CLI before any model loads
        (``engine_worker.options.paths``; direct construction, as in tests, skips them).
        Raises ``ValueError`` naming the option."""
        check_worker_paths(self.backend, self.model_dir, self.draft_model_dir, self.n_gpu_layers)

    @property
    def drafting(self) -> str | None:
        """``Ready.drafting``: the draft mode's name, or ``None`` without drafting."""
        return None if self.draft_mode is DraftMode.NONE else self.draft_mode.value


FOREIGN_OPTIONS: dict[str, str] = {
    "--gpu-memory-utilization": (
        "vLLM's fraction of GPU memory has no counterpart here: ExLlamaV3 takes the weights plus the KV "
        "cache you size with --cache-size (tokens), placed with --gpu-split (GB per GPU); the cpu engine's "
        "KV budget is --kv-cache-mb"
    ),
    "--tensor-parallel-size": "use --tensor-parallel (exllamav3: every GPU in --gpu-split, or all)",
    "-tp": "use --tensor-parallel (exllamav3: every GPU in --gpu-split, or all)",
    "--kv-cache-dtype": "use --cache-mode (exllamav3: FP16, or k_bits,v_bits such as 8,8)",
    "--batch-size": "the prefill chunk is --chunk-size (tokens); sequences at once are --max-batch-size",
    "-b": "the prefill chunk is --chunk-size (tokens); sequences at once are --max-batch-size",
    "--ubatch-size": "the prefill chunk is --chunk-size (tokens)",
    "--model-draft": "use --draft-model-dir with --draft-mode draft_model (exllamav3)",
    "-md": "use --draft-model-dir with --draft-mode draft_model (exllamav3)",
    "--draft-max": "use --num-draft-tokens",
    "--speculative-config": "use --draft-mode (ngram, draft_model, mtp) and --num-draft-tokens",
    "--host": "a proxy option: give it to exl3-sidecar serve or exl3-sidecar proxy",
    "--port": "a proxy option: give it to exl3-sidecar serve or exl3-sidecar proxy",
}
"""Flags of llama.cpp's ``llama-server`` and vLLM's ``vllm serve`` that the worker
does not take, each with what to use instead: ``protocol.settings.HintedCommand``
refuses them with that hint (names from llama.cpp ``tools/server/README.md`` and
vLLM's engine arguments)."""
