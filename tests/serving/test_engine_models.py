"""The serving engine on the real models: greedy outputs of requests arriving over time equal
``generate``'s for each request (SmolLM2-135M, 32 requests; Gemma 3 270M past its 512-token
window, with a prefix-cache hit that resumes prefill mid-prompt; SmolLM2 with speculation, and
with page retrieval)."""

import numpy as np
from jaxkv.models.load import load_pretrained

from jaxkv.decoding.generate import generate
from jaxkv.retrieval import RetrievalSpec
from jaxkv.serving import Engine
from jaxkv.serving.speculation import SpeculativeConfig
from tests.cases import PARAGRAPH, greedy_reference, run_arrivals

NEW_TOKENS = 16
TOPICS = ["rivers", "bread", "volcanoes", "chess", "bees", "glass", "trains", "comets"]


def test_smollm2_32_requests_arriving_over_time_equal_generate():
    model, tokenizer = load_pretrained("smollm2")
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(32):
        question = f"Tell me {int(rng.integers(1, 6))} facts about {TOPICS[i % len(TOPICS)]}. " * int(
            rng.integers(1, 24)
        )
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}])))
    assert min(map(len, prompts)) < 60 < 150 < max(map(len, prompts))
    engine = Engine(model, kv_memory="96MiB", max_num_seqs=8, max_num_batched_tokens=64)
    got = run_arrivals(engine, prompts, sorted(rng.integers(0, 60, len(prompts)).tolist()), NEW_TOKENS)
    expected = greedy_reference(model, prompts, NEW_TOKENS)
    assert [row for row in range(32) if got[row] != expected[row]] == []
    stats = engine.stats()
    assert stats.num_compiled <= len(engine.config.prefill_buckets()) and stats.pages["full"].used == 0


def test_gemma3_past_its_window_and_a_mid_prompt_prefix_hit_equal_generate():
    model, tokenizer = load_pretrained("gemma3")
    long = tokenizer.encode(PARAGRAPH * 7 + "In summary, the printing press")
    assert len(long) > 600  # past the 512-token sliding window
    prompts = [long, long[:560] + tokenizer.encode(" To conclude, books"), tokenizer.encode("The capital of France is")]
    engine = Engine(model, kv_memory="128MiB", max_num_seqs=4, max_num_batched_tokens=64)
    first = run_arrivals(engine, prompts[:1], [0], NEW_TOKENS)
    rest = run_arrivals(engine, prompts[1:], [0, 2], NEW_TOKENS)
    hit = engine.sequences[1][0]
    assert hit.num_cached_tokens == 560 // 16 * 16  # resumed mid-prompt, window pages still cached
    assert first + rest == greedy_reference(model, prompts, NEW_TOKENS)
    assert engine.stats().pages["sliding"].usable < engine.stats().pages["full"].usable


def test_stop_strings_with_the_real_tokenizer():
    model, tokenizer = load_pretrained("smollm2")
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "List five fruits."}]))
    engine = Engine(model, kv_memory="32MiB", max_num_seqs=2, max_num_batched_tokens=64, tokenizer=tokenizer)
    full = engine.generate_many([prompt], max_tokens=24, ignore_eos=True, cache_salt="a")[0]
    stop = full.text.split()[3]
    cut = engine.generate_many([prompt], max_tokens=24, ignore_eos=True, stop=[stop], cache_salt="a")[0]
    assert cut.finish_reason == "stop" and full.text.startswith(cut.text) and stop not in cut.text
    assert cut.num_cached_tokens > 0


def test_smollm2_speculation_equals_generate():
    """SmolLM2 with prompt lookup (k=4) on requests that copy a passage and on plain questions,
    arriving over time: every request gets ``generate``'s greedy tokens, and copying keeps many drafts."""
    model, tokenizer = load_pretrained("smollm2")
    asks = [f"Repeat the following text exactly:\n\n{PARAGRAPH}", "Tell me 3 facts about bees.",
            f"Fix the spelling in this text:\n\n{PARAGRAPH.replace('the', 'teh')}", "List five fruits."]  # fmt: skip
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ask}])) for ask in asks]
    engine = Engine(model, kv_memory="64MiB", max_num_seqs=4, max_num_batched_tokens=64,
                    speculative=SpeculativeConfig(num_tokens=4, always_verify=True))  # fmt: skip
    got = run_arrivals(engine, prompts, [0, 0, 3, 5], 32)
    assert got == greedy_reference(model, prompts, 32)
    copying = engine.sequences[0][0]
    assert copying.num_accepted > 0.4 * copying.num_proposed > 0


def test_smollm2_retrieval_equals_generate():
    """Quest over the pool (256 tokens of pages of 16 a decode token, minmax, prompts dense) on
    SmolLM2, prompts of 300 to 700 tokens arriving over time, the last sharing the first's prefix
    pages: every request gets ``generate``'s greedy tokens with the same ``RetrievalSpec``, and
    some differ from full attention's (the budget chooses)."""
    model, tokenizer = load_pretrained("smollm2")
    spec = RetrievalSpec(256, prefill="dense")
    asks = [PARAGRAPH * 3 + "Summarize the text.", PARAGRAPH * 6 + "Who combined movable type with a press?",
            PARAGRAPH * 4 + "What changed for books?", PARAGRAPH * 3 + "Name the inventor."]  # fmt: skip
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ask}])) for ask in asks]
    assert 300 < min(map(len, prompts)) and max(map(len, prompts)) < 700
    engine = Engine(model, kv_memory="64MiB", max_num_seqs=4, max_num_batched_tokens=128, retrieval=spec)
    got = run_arrivals(engine, prompts, [0, 0, 2, 6], 24)
    result = generate(model, prompts, max_new_tokens=24, stop_tokens=(), retrieval=spec)
    assert got == [result.row(i) for i in range(len(prompts))]
    assert got != greedy_reference(model, prompts, 24)
    assert engine.sequences[3][0].num_cached_tokens > 0
