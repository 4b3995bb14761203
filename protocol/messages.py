"""Typed messages exchanged by the proxy and the engine worker over ZeroMQ.

Definitions only. Every message is a ``msgspec.Struct`` encoded as a tagged
MessagePack array (``array_like=True``): field order is part of the wire
format. Evolve it the way msgspec documents: append fields with defaults at the
end, never reorder or remove, and only add enum values. Anything else bumps
``protocol.version.PROTOCOL_VERSION``.

Direction proxy -> worker (``ProxyMessage``): ``Hello``, ``Submit``, ``Abort``,
``Tokenize``, ``Detokenize``.
Direction worker -> proxy (``WorkerMessage``): ``Loading`` (while the model
loads, before any ``Ready``), ``Ready``, ``Heartbeat``,
``EventBatch`` (the events of one engine step: ``QueueProgress``, ``Started``, ``PrefillProgress``,
``TokenDelta``, ``Finished``, ``RequestError``; ``Tokens`` and ``Detokenized``,
the one answer to a ``Tokenize``/``Detokenize`` unless a ``RequestError``).

Per request the worker emits, in order: ``QueueProgress`` while it waits in the
worker's queue (none when it starts at once); ``Started``; one or more
``PrefillProgress`` (the first with ``processed == cached``, the last with
``processed == total``); zero or more ``TokenDelta``; then exactly one of
``Finished`` or ``RequestError``. Counts are tokens, times are seconds unless a
field name says ``_ms``.
"""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.StrEnum):
    """Why generation ended, already in OpenAI's ``finish_reason`` vocabulary."""

    STOP = "stop"  # EOS token, stop string or stop token id
    LENGTH = "length"  # max_tokens reached, or the context is full


class Channel(enum.StrEnum):
    """Which part of a reasoning model's output a token belongs to: its thinking
    (``reasoning``) or its answer (``content``). Models without a reasoning parser
    write only ``content``."""

    CONTENT = "content"
    REASONING = "reasoning"


class ErrorCode(enum.StrEnum):
    """Error kinds a worker reports; the proxy maps each to an HTTP status."""

    INVALID_REQUEST = "invalid_request"  # 400
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # 400
    OVERLOADED = "overloaded"  # 503
    INTERNAL = "internal_error"  # 500
    QUEUE_FULL = "queue_full"  # 429: the worker's queue is full now; a retry later can succeed
    ABORTED = "aborted"  # 503: an Abort for the request arrived; a retry can succeed


class _Msg(msgspec.Struct, array_like=True, frozen=True, tag=True):
    pass


# ---------------------------------------------------------------- proxy -> worker


class ImageInput(msgspec.Struct, array_like=True, frozen=True):
    """One image of a chat turn: the file's ``data`` as the client sent it
    (PNG, JPEG, WebP or GIF, whose first frame counts), checked by the proxy
    before it is sent (format, bytes, pixels, a full decode: ``proxy.core.images``).

    ``offset`` is where the image sits in its message's ``content``, in
    characters: each image was one part of the content, and parts are joined
    with ``"\n"``, an image counting as an empty part, so ``[text "a", image,
    text "b"]`` is content ``"a\n\nb"`` with the image at offset 2. The worker
    writes the model's image placeholder there; no text of the client ever
    stands for an image. ``param`` names the part in the client's terms
    (``messages[0].content[1]``, ``input[0].content[1]``), for errors about it."""

    data: bytes
    offset: int
    param: str


MODALITY_TEXT = "text"
MODALITY_IMAGE = "image"


class ChatMessage(msgspec.Struct, array_like=True, frozen=True):
    """One chat turn, content already flattened to text, its images apart (``images``).

    The tool side of a turn, only when the model's chat template renders tools
    itself (``Submit.tools_json``): ``tool_calls_json`` (assistant: a JSON array
    of ``{"id", "type": "function", "function": {"name", "arguments": object}}``,
    arguments decoded as templates expect them), ``tool_call_id`` and ``name``
    (tool results)."""

    role: str
    content: str
    tool_calls_json: str | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    """An assistant turn's thinking sent back by the client (``reasoning_content``,
    Responses reasoning items, Anthropic thinking blocks): the worker gives it to
    the template as the turn's ``reasoning_content`` (Qwen3, DeepSeek) and
    ``thinking`` (GPT-OSS), which renders or drops it; never as content."""
    images: tuple[ImageInput, ...] = ()
    """The turn's images, in order of ``offset`` (``ImageInput``); only a worker whose
    ``Ready.modalities`` has ``"image"`` is sent any."""


MAX_STOP_STRINGS = 64
"""Most stop strings of one request the worker takes (``SamplingParams.stop``);
each dialect of the proxy allows at most this many (``proxy.core.fields``).
Bounding them bounds the stop automaton every sequence carries
(``engine_worker.requests.stops``) and, on ExLlamaV3, its own per-token scan."""

MAX_STOP_CHARS = 256
"""Most characters of one stop string (``SamplingParams.stop``): what a stream
holds back while it may still become one is at most this long."""


class SamplingParams(msgspec.Struct, array_like=True, frozen=True):
    """Sampling and stopping controls for one sequence.

    ``max_tokens`` counts completion tokens. ``top_k == 0`` and ``top_p == 1.0``
    and ``min_p == 0.0`` disable those filters; ``temperature == 0.0`` means greedy.
    ``logit_bias`` maps token id to an additive bias on the logits.

    ``logprobs``: ``None`` for none; ``k`` (0..20) to get, on every ``TokenDelta``,
    each generated token's log-probability and the ``k`` most likely
    alternatives (``TokenLogprob``). They are taken from the distribution the
    token was sampled from: logits after ``logit_bias``, the penalties and the
    grammar mask, divided by the temperature (1 when greedy), with tokens that
    ``top_k``/``top_p``/``min_p`` removed left out (probability 0).

    ``grammar``: ``None``, or an llguidance grammar (a Lark grammar, or the JSON
    that ``llguidance.LLMatcher.grammar_from_json_schema`` returns) that every
    generated sequence must match; the worker masks the logits with it (drafted
    tokens included) and ends the sequence with ``stop`` once the grammar is
    complete and nothing else may follow. ``grammar_param`` names the request
    field it came from, for error messages (``response_format``, ``tools``,
    ``tool_choice``).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    grammar: str | None = None
    grammar_param: str | None = None
    temperature_last: bool = False
    """Temperature after top-k/top-p/min-p (on the surviving probabilities) instead of before."""
    penalty_range: int = -1
    """Most recent context tokens the penalties apply to in full; -1: the whole context.
    With ``repetition_decay`` ``d``, a token ``t`` positions beyond the range is penalised
    with weight ``1 - t / d`` (ExLlamaV3's sustain and decay ranges); 0 and 0: none."""
    repetition_decay: int = 0
    xtc_probability: float = 0.0
    """Exclude Top Choices: with this probability every token of probability at least
    ``xtc_threshold`` but the least likely of them is excluded (newline and special tokens
    never are); the engines average over the roll (ExLlamaV3's ``SS_XTC``). No effect greedy."""
    xtc_threshold: float = 0.1
    banned_tokens: tuple[int, ...] = ()
    """Token ids never sampled (masked before every other step)."""
    ban_eos_token: bool = False
    """The model's end-of-sequence ids are banned (and so never end the sequence)."""
    skip_special_tokens: bool | None = None
    """Special tokens' text is left out of the output (``True``) or kept (``False``);
    ``None``: the engine's default (the CPU engine leaves them out, ExLlamaV3 keeps them
    as TabbyAPI does). Stop tokens never show."""
    banned_strings: tuple[str, ...] = ()
    """Strings the output never contains (case-insensitive): text that may start one is
    held back, and a complete one rewinds the sequence to where it began and bans the
    token sampled there (ExLlamaV3's ``Job(banned_strings=...)``)."""
    dry_multiplier: float = 0.0
    """DRY ("don't repeat yourself", llama.cpp's and ExLlamaV3's ``SS_DRY``): a token that
    would extend a repeat of length ``n >= dry_allowed_length`` of the last ``dry_range``
    tokens (0: the whole context) loses ``dry_multiplier * dry_base ** (n -
    dry_allowed_length)`` from its logit; repeats cannot span a sequence breaker (a token
    whose text contains one of ``dry_sequence_breakers``; ``None``: ExLlamaV3's default set).
    0 (or a base below 1) is off."""
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_range: int = 0
    dry_sequence_breakers: tuple[str, ...] | None = None

    reasoning_budget: int | None = None
    """Most tokens the model may think before it answers (``Channel.REASONING``,
    the span's markers included), ``None`` for no limit but the worker's default
    (``--reasoning-budget``). Once spent, the worker writes the end of the span
    itself and the model answers; ``0``: no thinking (a span the prompt opens is
    closed in the prompt, a template that can switch thinking off is switched
    off). The ``grammar`` applies to the answer after the span, never to the
    thinking. Ignored by a worker without a reasoning parser."""


class PromptPiece(msgspec.Struct, array_like=True, frozen=True):
    """A run of text the proxy writes after the chat template (``Submit.forced_prefix``).

    ``control``: the piece is a tool-call format's marker (``[TOOL_CALLS]``,
    ``<|python_tag|>``), encoded as its one token when the model's tokenizer has
    it as a control token, else as text; any other piece is encoded with
    special-token parsing off, so no text in it becomes a control token."""

    text: str
    control: bool = False


class Hello(_Msg, frozen=True, tag="hello"):
    """Sent by the proxy on connect and while not ready; answered by ``Ready``."""

    protocol_version: int
    proxy_id: str


class Submit(_Msg, frozen=True, tag="submit"):
    """Start one request of ``n`` sequences (choices) on one prompt. Exactly one of
    ``messages`` (chat: the worker applies the model's chat template) or ``prompt``
    (raw text completion) is used.

    The prompt is tokenized once; the ``n`` sequences are admitted together or wait
    together, and their events carry the ids ``choice_ids(request_id, n)``. With a
    ``params.seed``, choice ``i`` samples with ``choice_seed(seed, i)``.
    """

    request_id: str
    params: SamplingParams
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | None = None
    add_generation_prompt: bool = True
    n: int = 1
    tools_json: str | None = None
    """The request's tools (OpenAI's ``tools`` array as JSON text) for a chat
    template that renders them (its ``tools`` variable); ``None`` otherwise. A
    worker that cannot pass them to its template refuses the request."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: prefix-cache entries are shared only between
    requests of the same salt (``None`` is a salt too: the shared one), so a
    tenant cannot learn from cache hits what another one sent. A worker whose
    engine cannot keep salts apart refuses a salted request."""
    forced_prefix: tuple[PromptPiece, ...] = ()
    """Chat only: text the worker appends to the prompt after the chat template
    (its generation prompt included), as if the model had already written it;
    the output, its grammar and its token counts start after it. The proxy
    writes it for a named ``tool_choice``: the call's opening markup and the
    function's name (``proxy.tools.grammar.named_call_prefix``), so the model
    generates only the arguments, as vLLM does."""
    add_bos: bool | None = None
    """Whether ``prompt`` starts with the model's BOS token (TabbyAPI's ``add_bos_token``);
    ``None``: the engine's own choice. With ``messages`` the chat template places BOS and
    the worker refuses any other value (``param`` ``add_bos_token``)."""
    template_kwargs_json: str | None = None
    """Extra variables for the chat template, a JSON object (vLLM's and
    llama.cpp's ``chat_template_kwargs``: ``enable_thinking``, and
    ``reasoning_effort`` where the request set one); ``None`` for none. Values
    are client text, escaped as such (``engine_worker.client_text``)."""


def choice_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of the ``n`` choices of ``request_id``: the request id
    itself for one choice, ``f"{request_id}-{i}"`` for several."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice ``i``: ``seed + i`` wrapped to int64, so a request stays
    reproducible while its choices differ (as OpenAI's and vLLM's do)."""
    return (seed + i + 2**63) % 2**64 - 2**63


class Abort(_Msg, frozen=True, tag="abort"):
    """Free the engine work of these choices (``choice_ids``) at the next engine
    step, queued ones included (a queued request leaves whole, all its choices).
    Unknown or already finished ids are ignored; every choice dropped gets a
    terminal ``RequestError`` (``OVERLOADED``), which the proxy that sent the
    Abort ignores and any other holder of the stream ends it on."""

    request_ids: tuple[str, ...]


class Tokenize(_Msg, frozen=True, tag="tokenize"):
    """Proxy -> worker: the prompt ``submit`` would run with (chat template,
    tools, tokenizing exactly as for generation), answered by one ``Tokens``
    (or a ``RequestError``) under ``submit.request_id``; nothing is queued or
    generated.

    ``add_special_tokens`` (vLLM's field, ``messages`` only): the tokenizer's own
    leading special tokens (BOS where it puts one before plain text) in front of what
    the chat template wrote, as vLLM tokenizes a rendered template with
    ``add_special_tokens=True``; a template that writes BOS itself then has two."""

    submit: Submit
    add_special_tokens: bool = False


class Detokenize(_Msg, frozen=True, tag="detokenize"):
    """Proxy -> worker: the text of ``token_ids``, answered by one
    ``Detokenized`` (or a ``RequestError``) under ``request_id``; with
    ``skip_special_tokens`` the special tokens (BOS, EOS, the template's control
    tokens) leave no text."""

    request_id: str
    token_ids: tuple[int, ...]
    skip_special_tokens: bool = False


ProxyMessage = Hello | Submit | Abort | Tokenize | Detokenize


# ---------------------------------------------------------------- worker -> proxy


class Ready(_Msg, frozen=True, tag="ready"):
    """Handshake answer and the worker's first message.

    ``worker_id`` changes on every worker start, so the proxy can tell a restart
    (and fail the requests the old process owned). ``drafting`` names the
    speculative decoding mode (``"ngram"``, ``"draft_model"``, ``"mtp"``) or is
    ``None``.
    """

    protocol_version: int
    worker_id: str
    model_id: str
    backend: str
    max_context_tokens: int
    drafting: str | None = None
    longest_token_chars: int = 0
    """Characters of the longest text one token decodes to (0: unknown). A prompt
    text longer than ``max_context_tokens * longest_token_chars`` cannot fit, so
    the proxy refuses it without sending it."""
    max_batch_size: int = 0
    """Most sequences running at once; more wait in the worker's queue."""
    max_queue: int = 0
    """Most requests waiting in the worker's queue; beyond it, ``QUEUE_FULL``."""
    kv_cache_tokens: int = 0
    """KV capacity in tokens shared by running sequences."""
    chat_template: str | None = None
    """Source of the model's chat template (Jinja), ``None`` when unknown; the
    proxy reads from it which tool-call format the model writes."""
    kv_block_tokens: int = 0
    """Tokens per block of the KV cache the prefix cache reuses in whole blocks
    (ExLlamaV3: its 256-token pages; the CPU engine: its prompt chunk), 0 when
    unknown. The proxy publishes it with ``kv_cache_tokens`` for routers that
    model prefix reuse per block (the Inference Extension's prefix scorer)."""
    reasoning_parser: str | None = None
    """The reasoning parser the worker splits output with (``deepseek_r1``,
    ``qwen3``, ``gpt_oss``, ``mistral``), ``None`` for none: then every delta
    is ``content``."""
    kernels: dict[str, str] | None = None
    """The CPU engine's kernel for each product it can run more than one way
    (``{"head": "int_mm", "layers": "vnni", "attention": "llvm"}``, chosen at
    start by measured speed: ``engine_worker.cpu.kernel_choice``); ``None`` for
    other engines."""
    modalities: tuple[str, ...] = (MODALITY_TEXT,)
    """What the loaded model reads: ``("text",)``, or ``("text", "image")`` for a
    vision model. A worker that predates the field says nothing and is taken for
    text only, so no image is sent to a worker that would drop it."""


class Loading(_Msg, frozen=True, tag="loading"):
    """Worker -> proxy while the worker loads its model, before its first ``Ready``
    (answers to ``Hello`` wait for the load): the load stage it is in, on each
    change and at least once a second. ``stage``: ``import``, ``convert``,
    ``load_weights``, ``kernels``, ``quantize``, ``warm_up`` (``engine_worker.load_stages.Stage``);
    ``label``: the stage in words for people (``"quantize weights (int4)"``);
    ``done`` of ``total`` units of it (``total`` 0: not counted); ``elapsed_ms``:
    milliseconds in the stage; ``load_ms``: since the load began."""

    worker_id: str
    stage: str
    label: str
    done: int
    total: int
    elapsed_ms: int
    load_ms: int


class Heartbeat(_Msg, frozen=True, tag="heartbeat"):
    """Liveness signal at a fixed interval, from a thread of its own: it keeps
    coming while an engine step is long, and stops only when the process is gone
    or hung. ``active_requests``: sequences running; ``waiting_requests``:
    requests in the worker's queue; ``kv_cache_usage``: fraction (0..1) of the KV
    capacity reserved by running sequences; ``step_s``: seconds the engine
    thread has been inside its current step (0 between steps)."""

    worker_id: str
    active_requests: int
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    step_s: float = 0.0
    running_requests: int | None = None
    """Requests running (a request with ``n`` choices counts once; ``active_requests``
    counts its ``n`` sequences); ``None`` from a worker that does not say."""
    kv_events_dropped: int = 0
    """KV-cache event batches (``--kv-events-endpoint``) this worker process dropped
    because its publishing queue was full, since it started (a counter that a worker
    restart resets); 0 when it publishes none."""


class QueueProgress(_Msg, frozen=True, tag="queued"):
    """The request waits in the worker's queue for a batch slot or KV-cache room.

    Sent for choice 0's id (``choice_ids``; all choices wait together) when the
    request is queued and whenever its ``position`` changes, at most every
    ``QUEUE_PROGRESS_INTERVAL_S``. ``position``: 1-based among the waiting
    requests (1: next to start); ``queued``: requests waiting; ``time_ms``: ms
    since the worker received it (preparation included); ``eta_ms``: estimated ms until it starts, from the
    rate at which the queue has been emptying, ``None`` when that rate is not
    known well enough to say."""

    request_id: str
    position: int
    queued: int
    time_ms: int
    eta_ms: int | None = None


QUEUE_PROGRESS_INTERVAL_S = 0.25
"""Least seconds between two ``QueueProgress`` events of one request."""


class Started(_Msg, frozen=True, tag="started"):
    """The prompt is tokenized and admitted. ``cached_tokens`` of the
    ``prompt_tokens`` are reused from the prefix cache."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int


class PrefillProgress(_Msg, frozen=True, tag="progress"):
    """Prompt processing progress, llama.cpp's ``prompt_progress`` semantics.

    ``processed`` counts prompt tokens in the KV cache, cached ones included;
    non-decreasing and ending at ``total``. ``time_ms`` is milliseconds since
    prompt processing of this request started.
    """

    request_id: str
    total: int
    cached: int
    processed: int
    time_ms: int


class TopLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One alternative token: its text, natural-log probability and raw bytes."""

    token: str
    logprob: float
    token_bytes: bytes


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One generated token with its log-probability (``SamplingParams.logprobs``).

    ``token`` is the text it adds to the content: the ``token`` of the entries
    of a ``TokenDelta``, joined, equal its ``text`` (a token whose bytes end
    inside a UTF-8 character adds nothing until the token that completes it; a
    token cut by a stop string adds only what is shown). ``token_bytes`` are the
    token's own bytes. ``top``: the most likely tokens at that position, most
    likely first."""

    token: str
    logprob: float
    token_bytes: bytes
    top: tuple[TopLogprob, ...] = ()


class TokenDelta(_Msg, frozen=True, tag="delta"):
    """New completion text (complete UTF-8, stop strings already removed) and
    the number of tokens it came from. ``text`` may be empty while output is held
    back; such deltas are not forwarded as content. ``logprobs``: one entry per
    token whose text is in ``text``, only when the request asked
    (``SamplingParams.logprobs``); held-back tokens come with the text they
    release."""

    request_id: str
    text: str
    num_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    channel: Channel = Channel.CONTENT
    """Thinking or answer: a reasoning model's deltas are one channel each (the
    worker splits on the span's marker tokens, which no delta shows); ``logprobs``
    come with ``content`` deltas only."""


class Finished(_Msg, frozen=True, tag="finished"):
    """Final counters of one sequence.

    ``draft_accepted``/``draft_rejected`` are ``None`` when drafting was not
    active; otherwise their sum is the number of drafted positions the target
    model verified. Times are seconds: ``time_queued`` from the worker's receipt
    of the ``Submit`` to the start of prefill (tokenizing and waiting for
    admission included), then prefill, then decode.
    """

    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    draft_accepted: int | None = None
    draft_rejected: int | None = None
    time_queued: float = 0.0
    time_prefill: float = 0.0
    time_decode: float = 0.0
    reasoning_tokens: int = 0
    """Of ``completion_tokens``, those the model spent thinking
    (``Channel.REASONING``, the span's markers included)."""


class RequestError(_Msg, frozen=True, tag="error"):
    """A request failed in the worker. ``request_id`` is ``None`` for a failure
    of the worker as a whole (every in-flight request is then lost)."""

    request_id: str | None
    code: ErrorCode
    message: str
    param: str | None = None


class Tokens(_Msg, frozen=True, tag="tokens"):
    """Worker -> proxy: the answer to ``Tokenize``: the prompt's token ids."""

    request_id: str
    token_ids: tuple[int, ...]


class Detokenized(_Msg, frozen=True, tag="detokenized"):
    """Worker -> proxy: the answer to ``Detokenize``."""

    request_id: str
    text: str


Event = (
    QueueProgress | Started | PrefillProgress | TokenDelta | Finished | RequestError | Tokens | Detokenized
)


class EventBatch(_Msg, frozen=True, tag="events"):
    """The events of one engine step, in order."""

    events: list[Event]


WorkerMessage = Ready | Heartbeat | EventBatch | Loading
