"""One request's lifecycle, written once for every backend: what a backend feeds
token ids or engine results into, and the rules it starts and ends sequences by.

| module | what |
|---|---|
| ``choices`` | a request's later choices wait for the first one's prefill (``startable``) |
| ``turns`` | the conversation as chat templates read it; the request's thinking budget |
| ``events`` | the events that open a sequence; the small cache of per-request sampler tables |
| ``output`` | one sequence's output pipeline: token ids in, ``TokenDelta`` text out |
| ``detokenize`` | incremental detokenization, a character never split across deltas |
| ``stops`` | the client's stop strings over the emitted text (one automaton) |
| ``banned`` | banned strings as ExLlamaV3's ``Job`` enforces them: hold, rewind, ban |
| ``logprobs`` | the logprob entries of each delta, lined up with its text |
"""
