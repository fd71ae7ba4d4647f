"""The draft-model proposer over simulated engine steps: its drafts are the draft model's greedy
continuation of each sequence (``generate``), through catch-ups, rejections, rows changing hands
and released rows, in a bounded set of compiled calls; with the target as its own draft every
draft is the target's greedy token."""

import numpy as np
import pytest
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.decoding.generate import generate
from jaxkv.serving.draft_proposer import (
    MIN_WIDTH,
    DraftProposer,
    catch_up_pieces,
    catch_up_widths,
    common_prefix,
    row_buckets,
)
from jaxkv.serving.requests import RequestOptions, SequenceState, Status
from tests.cases import TINY_LLAMA, VOCAB, greedy_reference

K = 3  # drafts per step
ROWS = 4
MAX_LEN = 30  # the engine's max_model_len
CHUNK = 4  # catch-up chunk: prompts longer than it are fed in chunks
# Per row bucket: the full-chunk feed and one call per catch-up width.
COMPILED = len(row_buckets(ROWS)) * (len(catch_up_widths(CHUNK)) + 1)
DRAFT = TINY_LLAMA | {"num_hidden_layers": 2, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def draft():
    return Llama(LlamaConfig(**DRAFT), seed=1)


def running(request_id: int, prompt: list[int], row: int, output: list[int] = ()) -> SequenceState:
    """A sequence on ``row`` whose last token is not computed yet."""
    computed = len(prompt) + len(output) - 1
    return SequenceState(
        request_id, 0, list(prompt), RequestOptions(), 0.0, list(output), num_computed=computed,
        status=Status.RUNNING, row=row,
    )  # fmt: skip


def draft_continuations(model, seqs: list[SequenceState]) -> list[list[int]]:
    """``generate``'s greedy ``K`` tokens after each sequence's tokens, in a batch padded to
    ``ROWS`` rows and a cache of fixed length (rows are independent; few compiles)."""
    prompts = [seq.tokens for seq in seqs]
    result = generate(model, prompts + [prompts[0]] * (ROWS - len(prompts)), max_new_tokens=K, stop_tokens=(),
                      max_length=64)  # fmt: skip
    return [result.row(i) for i in range(len(prompts))]


def test_catch_up_pieces_widths_and_common_prefix():
    def pieces(start):
        return [(position, piece.tolist()) for position, piece in catch_up_pieces(np.arange(11), start, 4)]

    assert pieces(0) == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9, 10])]
    assert pieces(2) == [(2, [2, 3, 4, 5]), (6, [6, 7, 8, 9]), (10, [10])]
    assert pieces(3) == [(3, [3, 4, 5, 6]), (7, [7, 8, 9, 10])]
    assert pieces(10) == [(10, [10])]
    assert catch_up_widths(4) == (2, 4)
    assert catch_up_widths(20) == (2, 8, 20)
    assert catch_up_widths(1) == (1,)
    assert row_buckets(32) == (1, 4, 16, 32)
    assert row_buckets(4) == (1, 4)
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 4])) == 2
    assert common_prefix(np.zeros(0, np.int32), np.array([1])) == 0


def test_drafts_are_the_draft_models_greedy_continuation(draft):
    """Several rows of different lengths (prompts longer than a chunk), limits from 0 to k and cut at
    max_model_len, drafts partly kept then a token of the target's: every draft list is the draft
    model's greedy continuation of the sequence's tokens. A row taken over (sharing a prefix with its
    previous sequence), a released row and a sequence back on another row change nothing; rows that
    do not propose are left as they were; no row passes max_model_len; nothing compiles after warmup."""
    rng = np.random.default_rng(0)
    proposer = DraftProposer(draft, num_rows=ROWS, max_model_len=MAX_LEN, num_tokens=K, chunk_size=CHUNK)
    proposer.warmup()
    assert proposer.num_compiled == COMPILED
    prompt = lambda n: rng.integers(0, VOCAB, n).tolist()  # noqa: E731
    seqs = {0: running(0, prompt(1), 0), 1: running(1, prompt(6), 1), 2: running(2, prompt(11), 2)}
    next_id, proposals = 3, 0
    for step in range(10):
        if step == 3:  # row 1 changes hands without a release; the new prompt shares 4 tokens with the old sequence
            seqs[1] = running(next_id, seqs[1].tokens[:4] + prompt(3), 1)
            next_id += 1
        if step == 5:  # row 0's sequence leaves (released); row 2's is preempted and comes back on row 3
            proposer.release(seqs[0])
            seqs[0] = running(next_id, seqs[0].tokens[:2] + prompt(2), 0)
            next_id += 1
            proposer.release(seqs[2])
            seqs[3] = running(seqs[2].request_id, seqs.pop(2).tokens, 3)
        order = sorted(seqs)
        limits = [int(rng.integers(0, K + 1)) if step else K for _ in order]
        lengths = [len(fed) for fed in proposer.fed]
        got = proposer.propose([seqs[row] for row in order], limits)
        expected = draft_continuations(draft, [seqs[row] for row in order])
        after = [len(fed) for fed in proposer.fed]
        assert max(after) <= MAX_LEN
        for row, limit, drafts, continuation in zip(order, limits, got, expected):
            seq = seqs[row]
            assert len(drafts) == min(limit, MAX_LEN - seq.num_tokens)
            assert drafts == continuation[: len(drafts)], (step, row)
            # The row holds the sequence and the drafts it fed; a row that did not propose is untouched.
            assert after[row] == (seq.num_tokens + len(drafts) - 1 if drafts else lengths[row])
            proposals += bool(drafts)
            # The engine keeps some drafts and then a token of the target's (a random one here).
            kept = int(rng.integers(0, len(drafts) + 1))
            seq.output += drafts[:kept] + [int(rng.integers(0, VOCAB))]
            seq.num_computed = seq.num_tokens - 1
        for row in [row for row in order if seqs[row].num_tokens >= MAX_LEN]:  # finished at the model's length
            proposer.release(seqs.pop(row))
    assert proposals > 15
    assert proposer.num_compiled == COMPILED


def test_target_as_its_own_draft_is_always_accepted():
    """The target drafting for itself: every draft is the target's greedy token, so a simulated
    greedy verification keeps all of them and the outputs equal ``generate``'s."""
    target = Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": 64}))
    prompts = [[5, 9, 2], [7] * 9, list(range(1, 14)), [3]]
    new_tokens = 12
    reference = greedy_reference(target, prompts, new_tokens)
    proposer = DraftProposer(target, num_rows=ROWS, max_model_len=MAX_LEN, num_tokens=K, chunk_size=CHUNK)
    seqs = [running(i, prompt, row, reference[i][:1]) for i, (prompt, row) in enumerate(zip(prompts, [2, 0, 3, 1]))]
    steps = 0
    while seqs:
        got = proposer.propose(seqs, [min(K, new_tokens - len(seq.output) - 1) for seq in seqs])
        for seq, drafts in zip(seqs, got):
            expected = reference[seq.request_id][len(seq.output) :]
            assert drafts == expected[: len(drafts)]
            seq.output += expected[: len(drafts) + 1]  # all kept, and the target's token after them
            seq.num_computed = seq.num_tokens - 1
        for seq in [seq for seq in seqs if len(seq.output) == new_tokens]:
            proposer.release(seq)
            seqs.remove(seq)
        steps += 1
    assert steps == 3  # 1 token from the prefill, then 4 a step
    assert proposer.num_compiled <= COMPILED


def test_bad_arguments_are_refused_by_name(draft):
    with pytest.raises(ValueError, match="num_tokens"):
        DraftProposer(draft, num_rows=ROWS, max_model_len=MAX_LEN, num_tokens=16)
    with pytest.raises(ValueError, match="max_model_len"):
        DraftProposer(draft, num_rows=ROWS, max_model_len=65, num_tokens=K)
    with pytest.raises(ValueError, match="chunk_size"):
        DraftProposer(draft, num_rows=ROWS, max_model_len=MAX_LEN, num_tokens=K, chunk_size=0)
    sliding = Llama(LlamaConfig(**DRAFT | {"sliding_window": 8}))
    with pytest.raises(ValueError, match="full-attention draft"):
        DraftProposer(sliding, num_rows=ROWS, max_model_len=MAX_LEN, num_tokens=K)
    proposer = DraftProposer(draft, num_rows=ROWS, max_model_len=MAX_LEN, num_tokens=K)
    with pytest.raises(ValueError, match="limits"):
        proposer.propose([running(0, [1, 2], 0)], [K + 1])
    with pytest.raises(ValueError, match="row"):
        proposer.propose([running(0, [1, 2], ROWS)], [1])
    with pytest.raises(ValueError, match="max_model_len"):
        proposer.propose([running(0, [1] * (MAX_LEN + 1), 0)], [1])
    with pytest.raises(ValueError, match="share rows"):
        proposer.propose([running(0, [1, 2], 0), running(1, [3], 0)], [1, 1])
    assert proposer.propose([running(0, [1] * MAX_LEN, 0)], [K]) == [[]]  # no room for a draft: nothing runs
    assert proposer.num_compiled == 0


def test_cost_predicts_the_catch_up_and_the_steady_call(draft):
    """Before ``warmup`` nothing is predicted; after it a new sequence's prediction includes its
    whole prompt's catch-up, and once its drafts were all kept and a token of the target's
    followed, the next call is the steady one: a catch-up of two tokens and the drafts, in one call."""
    proposer = DraftProposer(draft, num_rows=ROWS, max_model_len=MAX_LEN, num_tokens=K, chunk_size=CHUNK)
    seq = running(0, np.arange(11).tolist(), 1)
    assert proposer.cost([seq], [K]) is None
    proposer.warmup()
    assert proposer.token_seconds > 0 and proposer.drafting_seconds > 0
    new = proposer.cost([seq], [K])
    assert proposer.cost([seq], [0]) == 0.0
    drafts = proposer.propose([seq], [K])[0]
    assert proposer.calibration > 0
    seq.output += drafts + [5]
    seq.num_computed = seq.num_tokens - 1
    steady = proposer.calibration * proposer._predicted([("propose", 1, MIN_WIDTH)])
    assert proposer.cost([seq], [K]) == pytest.approx(steady) and new > steady / proposer.calibration > 0
