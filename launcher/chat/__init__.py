"""``exl3-sidecar chat``: a terminal client for any OpenAI-compatible (or Anthropic) server.

It streams one answer, through chat completions, the Responses API or
Anthropic's Messages (``--api``), and shows what this project's server adds to
the stream: the queue position (``queue_progress``), prefill progress
(``prompt_progress``, llama.cpp's format), and in the usage the cached prompt
tokens and the draft tokens accepted; servers that send none of them get the
answer and the usage alone.

| module | what |
|---|---|
| ``command`` | the click command, the prompt's sources, exit status |
| ``apis`` | each API's request and the reading of its stream into one kind of update |
| ``client`` | httpx + httpx-sse transport and the error tree |
| ``wire`` | each API's stream events, usage and error body as msgspec structs |
| ``session`` | one turn: updates in, times measured, a view told |
| ``stats`` | rates, eta, the usage summary and the words of the status lines |
| ``plain`` | the view for pipes (answer on stdout, status lines on stderr) |
| ``terminal`` | the view for a terminal (rich) |
"""

from launcher.chat.command import chat

__all__ = ["chat"]
