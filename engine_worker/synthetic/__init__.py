"""A model-less engine for load and fault tests (``--backend synthetic``).

``SyntheticBackend`` implements ``engine_worker.backend.Backend`` with the real
loop, sockets and admission around it, but no model: its output is a function of
the request (``expected_text``), so a test knows every stream's exact tokens.

| module | what |
|---|---|
| ``backend`` | ``SyntheticBackend`` and the text it writes for a request |
"""

from engine_worker.synthetic.backend import (
    STAMP,
    STAMP_WORD,
    SyntheticBackend,
    expected_text,
    prompt_words,
    strip_stamps,
)

__all__ = ["STAMP", "STAMP_WORD", "SyntheticBackend", "expected_text", "prompt_words", "strip_stamps"]
