"""The fake ExLlamaV3 generator reproduces the 1.6.5 quirks the backend relies on.

These tests pin the fake itself (the backend tests rest on it): each asserts a
behaviour read from the 1.6.5 source, cited in ``tests/fakes/exllamav3/``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import exllamav3 as fx


def _gen(**kw: Any) -> fx.Generator:
    g = fx.make_handle(**kw).generator
    assert isinstance(g, fx.Generator)
    return g


def _job(ids: list[int], **kw: Any) -> fx.Job:
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("stop_conditions", [fx.IM_END])
    return fx.Job(input_ids=fx.FakeTensor(ids), **kw)


def _drain(g: fx.Generator, limit: int = 2000) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(limit):
        if not g.num_remaining_jobs():
            return out
        out += g.iterate()
    raise AssertionError("generator did not drain")


def _prompt(n: int) -> list[int]:
    return [fx.BOS] + [0x61 + i % 26 for i in range(n - 1)]


def test_job_rejects_misspelt_keyword() -> None:
    with pytest.raises(TypeError):
        fx.Job(input_ids=fx.FakeTensor([1, 2]), max_new_token=3)  # type: ignore[call-arg]


def test_generator_rejects_misspelt_keyword() -> None:
    m = fx.Model()
    with pytest.raises(TypeError):
        fx.Generator(m, fx.Cache(m, 512), fx.Tokenizer(), max_chunk=256)  # type: ignore[call-arg]


def test_several_results_for_one_job_in_one_call() -> None:
    g = _gen(script=fx.reply("ok"))
    serial = g.enqueue(_job(_prompt(10)))
    first = g.iterate()
    assert [r["stage"] for r in first] == ["started", "prefill", "streaming"]
    assert all(r["serial"] == serial for r in first)
    assert first[1]["curr_progress"] == 9 and first[1]["max_progress"] == 9
    assert "identifier" not in first[0]


def test_fully_cached_page_aligned_prompt_emits_no_prefill() -> None:
    g = _gen(script=fx.reply("x"))
    prompt = _prompt(fx.PAGE_SIZE + 1)  # len - 1 is one whole page
    g.enqueue(_job(prompt))
    _drain(g)
    g.enqueue(_job(prompt, identifier="again"))
    second = _drain(g)
    stages = [r["stage"] for r in second]
    assert "prefill" not in stages and stages[0] == "started"
    eos = second[-1]
    assert eos["cached_pages"] == 1 and eos["cached_tokens"] == fx.PAGE_SIZE


def test_stop_token_leaves_held_text_out_of_text() -> None:
    g = _gen(script=fx.reply("abcEN"))
    g.enqueue(_job(_prompt(5), stop_conditions=[fx.IM_END, "END"]))
    res = _drain(g)
    eos = res[-1]
    assert eos["eos_reason"] == "stop_token" and "text" not in eos
    assert eos["held"]["text"] == "EN" + fx.SPECIAL_PIECES[fx.IM_END]
    assert eos["held"]["token_ids"].tolist() == [[ord("E"), ord("N"), fx.IM_END]]
    streamed = "".join(r.get("text", "") for r in res if r["stage"] == "streaming")
    assert streamed == "abc"


def test_error_result_has_no_identifier_and_others_continue() -> None:
    g = _gen(script=fx.reply("fine"), fail_prefill=lambda p: p[-1] == ord("!"))
    bad = g.enqueue(_job([*_prompt(5), ord("!")], identifier="bad"))
    good = g.enqueue(_job(_prompt(6), identifier="good"))
    res = _drain(g)
    errors = [r for r in res if r["stage"] == "error"]
    assert len(errors) == 1 and errors[0]["serial"] == bad
    assert set(errors[0]) == {"job", "serial", "stage", "eos", "error"}
    assert [r for r in res if r["serial"] == good][-1]["eos_reason"] == "stop_token"


def test_draft_keys_only_when_drafting() -> None:
    plain = _gen(script=fx.reply("ab"))
    plain.enqueue(_job(_prompt(4)))
    assert "accepted_draft_tokens" not in _drain(plain)[-1]
    drafting = _gen(script=fx.reply("ab"), drafting="ngram")
    drafting.enqueue(_job([fx.BOS, *b"xyz"]))  # nothing ever repeats: no draft, 0/0
    eos = _drain(drafting)[-1]
    assert eos["accepted_draft_tokens"] == 0 and eos["rejected_draft_tokens"] == 0


def test_speculative_pass_streams_one_dict_per_accepted_token() -> None:
    text = "la la la la la la la la la la "
    g = _gen(script=fx.reply(text), drafting="ngram", num_draft_tokens=3)
    g.enqueue(_job(_prompt(4), max_new_tokens=64))
    per_call = []
    res: list[dict[str, Any]] = []
    while g.num_remaining_jobs():
        batch = g.iterate()
        per_call.append(sum(1 for r in batch if r["stage"] == "streaming"))
        res += batch
    eos = res[-1]
    assert eos["accepted_draft_tokens"] > 0 and max(per_call) > 1
    assert sum(per_call) == eos["new_tokens"] == len(text) + 1
    assert "".join(r.get("text", "") for r in res) == text


def test_requeue_restarts_the_job_mid_stream() -> None:
    g = _gen(script=fx.reply("0123456789"))
    serial = g.enqueue(_job(_prompt(fx.PAGE_SIZE - 1), max_rq_tokens=1, max_new_tokens=20))
    res = _drain(g)
    stages = [(r["stage"], r.get("requeue", False)) for r in res if r["serial"] == serial]
    first_stream = stages.index(("streaming", False))
    rq = stages.index(("streaming", True))
    assert first_stream < rq < stages.index(("started", False), rq)
    eos = res[-1]
    assert eos["new_tokens"] == 11 and eos["prompt_tokens"] == fx.PAGE_SIZE - 1
    assert "".join(r.get("text", "") for r in res) == "0123456789"


def test_enqueue_asserts_when_the_job_cannot_fit() -> None:
    g = _gen(cache_tokens=512)
    with pytest.raises(AssertionError, match=r"Job requires 3 pages \(only 2 available\)"):
        g.enqueue(_job(_prompt(600)))


def test_incomplete_utf8_is_held_until_complete() -> None:
    g = _gen(script=fx.reply("日".encode()))
    g.enqueue(_job(_prompt(3)))
    texts = [r.get("text") for r in _drain(g) if r["stage"] == "streaming"]
    assert texts == [None, None, "日", None]


# ------------------------------------------------------------------ page reservations


def _filled(pt: fx._PageTable, tokens: list[int]) -> fx._Page:
    """Put one complete prompt page into the table, as a finished job leaves it."""
    h = fx._chain_hash(None, tokens)
    (page,), cached = pt.allocate([h], 0)
    assert cached == 0
    page.tokens, page.kv_position = list(tokens), fx.PAGE_SIZE
    pt.deallocate([page])
    return page


def test_unwritten_reservation_gives_the_page_back() -> None:
    pt = fx._PageTable(2)
    tokens = list(range(fx.PAGE_SIZE))
    page = _filled(pt, tokens)
    h = page.phash
    pages, _ = pt.allocate([], 2)
    assert page in pages and page.kv_position == 0 and h not in pt.by_hash
    pt.deallocate(pages)
    assert pt.by_hash[h] is page and page.kv_position == fx.PAGE_SIZE and page.tokens == tokens
    again, cached = pt.allocate([h], 0)
    assert again == [page] and cached == 1


def test_written_reservation_keeps_what_was_written() -> None:
    g = _gen(cache_tokens=2 * fx.PAGE_SIZE, script=fx.reply("ok"))
    page = _filled(g.pagetable, list(range(fx.PAGE_SIZE)))
    old = page.phash
    g.enqueue(_job(_prompt(300), max_new_tokens=2))
    _drain(g)
    # the prompt's second page went where the old content was: the job wrote it
    assert old not in g.pagetable.by_hash and not page.can_revert
    assert page.kv_position == 300 - fx.PAGE_SIZE + 1 and page.tokens[0] == _prompt(300)[fx.PAGE_SIZE]


def test_restored_page_whose_hash_was_taken_meanwhile_gets_a_fresh_one() -> None:
    pt = fx._PageTable(2)
    tokens = list(range(fx.PAGE_SIZE))
    page = _filled(pt, tokens)
    h = page.phash
    reserved, _ = pt.allocate([], 2)
    assert page in reserved
    # another job rebuilds the same content in the other page while this one is reserved
    other = next(p for p in pt.pages if p is not page)
    pt.set_hash(other, h)
    other.kv_position = fx.PAGE_SIZE
    pt.deallocate([page])
    assert pt.by_hash[h] is other and page.phash != h and page.prev_hash is None
    assert page.kv_position == fx.PAGE_SIZE  # content back, under a hash nobody looks up


def test_prefill_leaves_the_page_after_a_mid_page_end_alone() -> None:
    # A prompt of 11 tokens prefills positions 0..9: pages 0..10 // 256 = 0 only
    # (job.py:1463,1646). The job's second page is a reservation over cached content and
    # must come back when the job ends.
    g = _gen(cache_tokens=2 * fx.PAGE_SIZE, script=fx.reply("ok"))
    page = _filled(g.pagetable, [0x7A] * fx.PAGE_SIZE)
    h = page.phash
    job = _job(_prompt(11), max_new_tokens=300)
    g.enqueue(job)
    g.iterate()
    assert page in job.allocated_pages and job.allocated_pages.index(page) == 1
    _drain(g)
    assert g.pagetable.by_hash.get(h) is page and page.kv_position == fx.PAGE_SIZE


@pytest.mark.parametrize("max_skips", [None, 4])
def test_max_skips_none_fails_like_1_6_5_once_a_job_is_skipped(max_skips: int | None) -> None:
    g = _gen(cache_tokens=4 * fx.PAGE_SIZE, script=fx.reply("a" * 50))
    g.enqueue(_job(_prompt(10), max_new_tokens=700))  # 3 of the 4 pages
    g.iterate()
    big = _job(_prompt(10), max_new_tokens=300, max_skips=max_skips)  # 2 pages: waits
    small = _job(_prompt(5), max_new_tokens=10)  # 1 page: would start past it
    g.enqueue(big)
    g.enqueue(small)
    if max_skips is None:
        with pytest.raises(TypeError):
            g.iterate()
    else:
        g.iterate()
        assert small in g.active_jobs and big in g.pending_jobs and big.skips == 1


def test_decode_drops_every_eos_and_out_of_vocab_id_and_wants_a_tensor() -> None:
    tok = fx.Tokenizer()
    ids = [0x61, fx.EOS, 0x62, fx.VOCAB_SIZE + 5, fx.IM_END, 0x63]
    assert tok.decode(fx.FakeTensor(ids, flat=True)) == "abc"
    assert tok.decode(fx.FakeTensor(ids)) == ["abc"]
    assert tok.decode(fx.FakeTensor([0x61, fx.EOS], flat=True), decode_special_tokens=True) == "a</s>"
    with pytest.raises(AssertionError, match="Tensor"):
        tok.decode([0x61, 0x62])


@pytest.mark.parametrize(("drafting", "cached"), [(None, fx.PAGE_SIZE), ("mtp", fx.PAGE_SIZE - 1)])
def test_mtp_never_reuses_the_page_of_the_last_prompt_token(drafting: str | None, cached: int) -> None:
    # 257 tokens: one complete prompt page, then the last token. MTP leaves that page out of
    # the reusable prefix (job.py:1329-1333) and keeps one real token out of the token-level
    # match (job.py:1476-1479), so a repeat reuses 255 tokens instead of the page.
    g = _gen(script=fx.reply("ok"), drafting=drafting)
    prompt = _prompt(fx.PAGE_SIZE + 1)
    g.enqueue(_job(prompt))
    _drain(g)
    g.enqueue(_job(prompt))
    out = _drain(g)
    (fin,) = [r for r in out if r["eos"]]
    assert fin["cached_tokens"] == cached
    # the rebuilt page took the content hash; the stale copy was cleared (job.py:678-682)
    full = [p for p in g.pagetable.pages if p.content_hashed and p.kv_position == fx.PAGE_SIZE]
    assert len(full) == 1 and g.pagetable.by_hash[full[0].phash] is full[0]


def test_decode_special_tokens_keeps_their_text_in_held_and_streamed_output() -> None:
    # job.py:971 picks the piece list by decode_special_tokens; tokenizer.py:727-736 gives every
    # special token its text there, whatever the tokenizer's plain decode does
    for special_pieces in (True, False):
        g = _gen(script=fx.reply([*b"a", fx.IM_START, *b"\xc3\xa9"]), special_pieces=special_pieces)
        g.enqueue(_job(_prompt(4), max_new_tokens=4, decode_special_tokens=True))
        out = _drain(g)
        text = "".join(r.get("text", "") for r in out)
        assert text == "a<|im_start|>é"


def test_a_new_generator_supersedes_the_old_one_on_the_same_cache() -> None:
    # generator.py:242-245 and 741-749
    g = _gen(script=fx.reply("ok"))
    g.enqueue(_job(_prompt(10)))
    g.iterate()
    new = fx.Generator(g.model, g.cache, g.tokenizer)
    with pytest.raises(RuntimeError, match="no longer owns its Cache"):
        g.iterate()
    assert g.num_remaining_jobs() == 0
    new.enqueue(_job(_prompt(10)))
    assert _drain(new)[-1]["eos"]


def test_non_finite_logits_escape_iterate_on_a_jobs_first_sample_only() -> None:
    # job.py:742-750 checks the first sampled token; iterate_gen does not contain it
    g = _gen(script=fx.reply("ok"))
    g.model.nonfinite = lambda prompt: True
    g.enqueue(_job(_prompt(10)))
    with pytest.raises(fx.NonFiniteLogits, match="serial 0"):
        g.iterate()
    g2 = _gen(script=fx.reply("okay"))
    g2.enqueue(_job(_prompt(10)))
    g2.iterate()
    g2.model.nonfinite = lambda prompt: True
    assert _drain(g2)[-1]["eos"]  # past its first token the check no longer runs


def test_a_sticky_device_error_fails_every_iterate() -> None:
    handle = fx.make_handle()
    g = handle.generator
    assert isinstance(g, fx.Generator)
    g.model.device_error = RuntimeError("CUDA error: an illegal memory access was encountered")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            g.iterate()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        handle.check_device()


def test_hf_chat_template_loads_the_directorys_tokenizer_on_first_use(tmp_path: Any) -> None:
    # tokenizer.py:866-867: AutoTokenizer of config.directory, unless hf_tokenizer is set
    fx.write_hf_tokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    tok = fx.Tokenizer(fx.Config.from_directory(str(tmp_path)))
    assert tok.hf_tokenizer is None
    msgs = [{"role": "user", "content": "hé <|im_end|>"}]
    ids = tok.hf_chat_template(msgs)
    assert type(tok.hf_tokenizer).__name__ != "ChatMLTemplate"
    assert ids.tolist() == fx.Tokenizer().hf_chat_template(msgs).tolist()


# ------------------------------------------------------------------ filters and probabilities


def _filter(grammar: str, **kw: Any) -> fx.LLGuidanceFilter:
    return fx.LLGuidanceFilter(fx.Tokenizer(), llg_grammar=grammar, **kw)


def test_a_filter_is_attached_when_the_job_starts_not_when_it_is_enqueued() -> None:
    g = _gen(script=fx.reply("no"), max_batch_size=1)
    g.enqueue(_job(_prompt(4), max_new_tokens=3))
    flt = _filter('start: "yes" | "no"', eos_after_completed=True)
    g.enqueue(_job(_prompt(5), filters=[flt]))
    g.iterate()
    assert flt.job is None  # job.py:1764-1773: Job.activate, from iterate_start_jobs
    out = _drain(g)
    assert flt.job is not None and flt.vocab_size == 288  # padded to 32 (generator.py:239)
    assert [r["eos_reason"] for r in out if r.get("eos")][-1] == "end_filter"


def test_a_filter_without_eos_after_completed_lets_the_model_end() -> None:
    g = _gen(script=fx.reply("no"))
    flt = _filter('start: "yes" | "no"')
    g.enqueue(_job(_prompt(5), filters=[flt]))
    out = _drain(g)
    (eos,) = [r for r in out if r.get("eos")]
    # complete, the filter goes inactive (filter.py:66-70) and the model's <|im_end|> ends the job
    assert not flt.is_active and eos["eos_reason"] == "stop_token"


def test_an_invalid_grammar_raises_in_the_constructor() -> None:
    with pytest.raises(ValueError, match="Invalid grammar"):
        _filter("start: (")


def test_probabilities_ride_with_their_tokens_and_stay_held_at_a_stop_token() -> None:
    g = _gen(script=fx.reply("ab"))
    g.enqueue(_job(_prompt(3), return_probs=True, return_top_tokens=2, stop_conditions=[fx.IM_END, "b"]))
    out = _drain(g)
    streamed = [r for r in out if r["stage"] == "streaming" and "token_ids" in r]
    for r in streamed:
        n = r["token_ids"].shape[-1]
        assert r["token_probs"].shape == (1, n) and r["top_k_tokens"].shape == (1, n, 2)
        assert r["top_k_probs"].shape == (1, n, 2)
    first = streamed[0]
    assert first["token_probs"].tolist()[0][0] == pytest.approx(fx.raw_probs(ord("a"))[ord("a")])
    assert first["top_k_tokens"].tolist()[0][0] == [ord("a"), ord("b")]


def test_probabilities_held_at_a_stop_token_are_in_held() -> None:
    g = _gen(script=fx.reply(b"a\xc3"))  # an incomplete character, held when <|im_end|> comes
    g.enqueue(_job(_prompt(3), return_probs=True, stop_conditions=[fx.IM_END]))
    out = _drain(g)
    (eos,) = [r for r in out if r.get("eos")]
    assert eos["eos_reason"] == "stop_token"
    held = eos["held"]
    assert held["token_ids"].tolist() == [[0xC3, fx.IM_END]]
    assert held["token_probs"].shape == (1, 2)  # job.py:949-961


class _ThreadRecordingFilter(fx.LLGuidanceFilter):
    def __init__(self, *a: Any, fail: bool = False, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.threads: list[str] = []
        self.fail = fail

    def get_next_logit_mask(self) -> Any:
        import threading

        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("llguidance matcher error: parser too complex")
        return super().get_next_logit_mask()


def test_filter_masks_are_computed_on_the_filter_pool_not_the_iterate_thread() -> None:
    # 1.6.5 submits get_next_logit_mask to a 16-thread pool before the forward pass and
    # after each accepted draft token (generator.py:319, 1703-1712, 1969-1979); the engine
    # thread only waits for the result (job.py:423-434).
    import threading

    g = _gen(script=fx.reply("yes"), drafting="ngram")
    flt = _ThreadRecordingFilter(fx.Tokenizer(), llg_grammar='start: "yes" | "no"', eos_after_completed=True)
    g.enqueue(_job(_prompt(5), filters=[flt]))
    out = _drain(g)
    assert [r["eos_reason"] for r in out if r.get("eos")] == ["end_filter"]
    assert len(flt.threads) == 3  # one mask per sampled position: "y", "e", "s"
    assert all(t.startswith("exllamav3-filter") for t in flt.threads)
    assert threading.current_thread().name not in flt.threads
    g.close()
    with pytest.raises(RuntimeError):
        g.filter_pool.submit(int)  # shut down with the generator (generator.py:871)


def test_a_mask_error_on_the_pool_raises_out_of_iterate() -> None:
    g = _gen(script=fx.reply("yes"))
    flt = _ThreadRecordingFilter(fx.Tokenizer(), llg_grammar='start: "yes"', fail=True)
    g.enqueue(_job(_prompt(5), filters=[flt]))
    with pytest.raises(RuntimeError, match="matcher error"):
        _drain(g)
    assert flt.threads and flt.threads[0].startswith("exllamav3-filter")


# ------------------------------------------------------------------ eviction order


def _page(
    pt: fx._PageTable, i: int, access: int, prev: fx._Page | None = None, filled: bool = True
) -> fx._Page:
    page = pt.pages[i]
    tokens = [i] * fx.PAGE_SIZE
    pt.set_hash(page, fx._chain_hash(prev.phash if prev is not None else None, tokens))
    page.prev_hash = prev.phash if prev is not None else None
    page.tokens, page.kv_position, page.access = tokens, fx.PAGE_SIZE, access
    return page


def test_eviction_takes_empty_pages_then_orphaned_chains_then_rooted_ones_each_from_its_leaves() -> None:
    # PageTable.build_eviction_order (pagetable.py:411-520): empty pages oldest first, then
    # trees whose root's predecessor is gone, then rooted trees, least recently used root
    # first, each pruned oldest leaf first so that the longest prefix survives.
    pt = fx._PageTable(10)
    lost = _page(pt, 9, access=1)
    a0 = _page(pt, 0, access=10)
    a1 = _page(pt, 1, access=11, prev=a0)
    a2 = _page(pt, 2, access=12, prev=a1)
    b1 = _page(pt, 3, access=5, prev=a1)  # a branch off a1, a leaf older than a2
    o1 = _page(pt, 4, access=50, prev=lost)
    o2 = _page(pt, 5, access=51, prev=o1)
    pt.clear(lost)  # o1's predecessor is gone: o1..o2 is orphaned, though used after a0..a2
    r0 = _page(pt, 6, access=20)
    r1 = _page(pt, 7, access=21, prev=r0)
    r1.ref_count = 1  # in use: r0 below it is not evictable by the tree walk
    empty = pt.pages[8]
    empty.access = 30
    order = list(pt.build_eviction_order(set()))
    assert [p.index for p in order] == [
        lost.index,  # empty (cleared): oldest first
        empty.index,
        o2.index, o1.index,  # the orphaned tree, leaf first
        b1.index, a2.index, a1.index, a0.index,  # oldest rooted tree, oldest leaf first
        r0.index,  # left over by the walk: last
    ]  # fmt: skip
    # protected pages (the allocating job's own prompt) go dead last
    assert [p.index for p in pt.build_eviction_order({o2.phash, a0.phash})][-2:] == [a0.index, o2.index]


def test_allocation_takes_pages_in_eviction_order_and_keeps_the_longest_prefix() -> None:
    pt = fx._PageTable(4)
    a0 = _page(pt, 0, access=1)
    a1 = _page(pt, 1, access=2, prev=a0)
    _page(pt, 2, access=3, prev=a1)
    pages, _ = pt.allocate([], 2)  # page 3 is empty; then a2, the chain's leaf
    assert [p.index for p in pages] == [3, 2]
    pt.deallocate(pages)
    _, cached = pt.allocate([a0.phash, a1.phash], 0)
    assert cached == 2


# ------------------------------------------------------------------ n-gram drafts


def _earliest_longest_earlier_suffix(seq: list[int]) -> tuple[int, int]:
    """By brute force: ``(begin, end)`` of the first occurrence, ending before the last
    token, of the longest suffix of ``seq`` that has one."""
    n = len(seq)
    for span in range(n - 1, 0, -1):
        for end in range(span, n):
            if seq[end - span : end] == seq[n - span :]:
                return end - span, end
    return -1, -1


def test_the_ngram_suffix_automaton_finds_the_earliest_occurrence_of_the_longest_suffix() -> None:
    # BC_SAM (exllamav3_ext/sam.cpp) matches as the sequence grows and drafts from a state's
    # first end position: the earliest occurrence, however long the suffix.
    import random

    for trial in range(300):
        rnd = random.Random(trial)
        seq = [rnd.randrange(rnd.choice([2, 3, 5])) for _ in range(rnd.randint(1, 60))]
        sam = fx._SuffixAutomaton()
        for i in range(1, len(seq) + 1, rnd.choice([1, 2, 7])):
            assert sam.accept(seq[:i]) == _earliest_longest_earlier_suffix(seq[:i]), (seq[:i], trial)
    # a passage seen twice with different continuations drafts the first one's
    seq = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    job = _job(seq)
    job.sequence_ids = seq
    assert job.ngram_draft(4, 2) == [7, 1, 2, 3]
