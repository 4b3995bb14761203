"""Wire protocol version spoken between proxy and engine worker.

Bump it whenever a change is not append-only (see ``protocol.messages``): the
proxy refuses a worker whose version differs, because the two containers of a
pod are upgraded separately.
"""

PROTOCOL_VERSION: int = 6
# 6: Loading (worker -> proxy while the model loads; a proxy of version 5 could not decode it).
# 5: ErrorCode.ABORTED (a proxy of version 4 could not decode it; aborts were OVERLOADED).
# 4: Tokenize / Detokenize (proxy -> worker) and Tokens / Detokenized events.
# 3: QueueProgress joins the Event union (a proxy of version 2 could not decode it);
#    logprobs and grammar in SamplingParams, logprobs in TokenDelta.
