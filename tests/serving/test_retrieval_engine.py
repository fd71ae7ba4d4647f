"""Page retrieval (Quest) in the engine (``EngineConfig.retrieval``): the full-attention pool keeps a
summary of each page's keys and each query reads a budget of its row's pages. Every request draws
the tokens ``generate`` draws with the same ``RetrievalSpec`` (chunked prefill, prefix hits,
preemption by recompute and by swap, NaN in every free page), a budget covering the context is
full attention, and the options that rewrite K/V are refused by name."""

import numpy as np
import pytest
from jaxkv.models.llama import Llama

from jaxkv.cli.main import build_parser
from jaxkv.cli.serve import ServeConfig, resolve_serve_config
from jaxkv.decoding.generate import generate
from jaxkv.eviction import EvictionSpec
from jaxkv.retrieval import RetrievalSpec
from jaxkv.serving import Engine
from jaxkv.serving.engine import EngineConfig
from jaxkv.serving.speculation import SpeculativeConfig
from jaxkv.sharding import make_mesh
from tests.cases import VOCAB, greedy_reference, run_arrivals
from tests.serving.conftest import LLAMA, poisoned
from tests.serving.test_engine_sharding import MESHES

SMALL = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_memory": 64 * 1024}
NEW_TOKENS = 12
# 4 pages of 4 tokens a query: the sink page, its own page and the 2 best scored in between.
SPECS = {
    "minmax-dense": RetrievalSpec(16, page_size=4, prefill="dense"),
    "minmax-retrieve": RetrievalSpec(16, page_size=4),
    "centroid-retrieve": RetrievalSpec(16, page_size=4, summary="centroid"),
}
# Prompts from under the budget to many pages past it; the last repeats the first (a prefix hit).
LENGTHS, ARRIVALS = [40, 23, 57, 9, 40], [0, 0, 1, 2, 4]


def prompts_of(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in LENGTHS[:-1]]
    return prompts + [prompts[0]]


def retrieved_reference(model, prompts, spec: RetrievalSpec) -> list[list[int]]:
    result = generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_tokens=(), retrieval=spec)
    return [result.row(i) for i in range(len(prompts))]


@pytest.mark.parametrize("spec", SPECS)
def test_every_request_draws_generates_tokens(model, spec):
    """Llama and Gemma 3 (its sliding pool untouched), prompts prefilled in chunks of up to 16 tokens
    over steps, a later request hitting the first one's prefix pages: each request's greedy tokens
    are ``generate``'s with the same retrieval, and they differ from full attention's. Under 'dense'
    every prompt token reads every page, as ``generate``'s prompt update does, wherever the step
    packs it (a prompt's last token after a prefix hit, or after a chunk, rides in a decode slot)."""
    prompts = prompts_of(0)
    expected = retrieved_reference(model, prompts, SPECS[spec])
    engine = Engine(model, retrieval=SPECS[spec], **SMALL)
    assert run_arrivals(engine, prompts, ARRIVALS, NEW_TOKENS) == expected
    assert expected != greedy_reference(model, prompts, NEW_TOKENS)  # the budget does choose
    if isinstance(model, Llama):  # Gemma's sliding pool has freed the pages its window left
        assert engine.stats().prefix_cache.hit_rate > 0


def test_a_budget_covering_the_context_is_full_attention(model):
    """Every page read: the greedy tokens of ``generate`` without retrieval."""
    prompts = prompts_of(1)
    engine = Engine(model, retrieval=RetrievalSpec(256, page_size=4), **SMALL)
    assert run_arrivals(engine, prompts, ARRIVALS, NEW_TOKENS) == greedy_reference(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_rows_and_poisoned_free_pages_change_nothing(llama, preemption):
    """A pool too small for every row, two preemptions forced besides, the summaries swapped to the
    host tier and back with their pages, NaN in every free page (and the null page, summaries
    included) after each step: every request draws what it draws alone, every page comes back. Under
    'dense' a recomputed sequence's outputs, prefilled again beside its prompt, still retrieve. No
    prefix caching: a free page still cached would be poisoned too, and then hit."""
    spec = SPECS["minmax-dense"]
    prompts = prompts_of(2)
    expected = retrieved_reference(llama, prompts, spec)
    tight = SMALL | {"kv_memory": 45 * 1024, "preemption": preemption, "host_kv_memory": 256 * 1024, "prefix_caching": False}
    engine = Engine(llama, retrieval=spec, **tight)
    ids = [engine.add_request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True) for prompt in prompts]
    step = 0
    while engine.has_unfinished():
        if step in (5, 11) and engine.scheduler.running:
            engine.scheduler.preempt(engine.scheduler.running[-1])
        engine.step()
        engine.runner.cache = poisoned(engine)
        engine.kv.check()
        step += 1
    stats = engine.stats()
    assert stats.preemptions > 2 and getattr(stats, preemption + "s") > 0
    assert [engine.sequences[i][0].output for i in ids] == expected
    pool = engine.kv.pools[0].manager
    assert pool.num_free == pool.num_usable


def test_summaries_sit_beside_the_pages_on_a_mesh():
    """A 4x2 mesh: each layer's page summaries are sharded as its pages (pages over ``data``, K/V
    heads over ``model``), and the tokens equal one-device ``generate``'s with the same retrieval."""
    spec = SPECS["minmax-dense"]
    prompts = prompts_of(3)
    expected = retrieved_reference(Llama(_config()), prompts, spec)
    engine = Engine(Llama(_config(), mesh=make_mesh(MESHES["4x2"])), retrieval=spec, **SMALL | {"max_num_seqs": 8, "kv_memory": 512 * 1024})
    assert run_arrivals(engine, prompts, ARRIVALS, NEW_TOKENS) == expected
    group = next(group for group in engine.runner.cache.groups if group.page_summaries is not None)
    pages, summaries = group.key_pages.sharding.spec, group.page_summaries.sharding.spec
    assert summaries[1] == pages[1] == "data" and summaries[3] == pages[3] == "model"


def _config():
    from jaxkv.models.llama import LlamaConfig

    return LlamaConfig(**LLAMA | {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8})


def test_the_summaries_are_counted_in_the_page_size(llama):
    """A retrieving pool's pages carry their minmax summary (2 vectors per page and K/V head, float32
    keys here: half a page of keys at pages of 4), so ``kv_memory`` holds fewer of them."""
    plain, retrieving = Engine(llama, **SMALL).sizes, Engine(llama, retrieval=SPECS["minmax-dense"], **SMALL).sizes
    assert retrieving.full_page_bytes == plain.full_page_bytes * 5 // 4
    assert retrieving.full_pages < plain.full_pages


def test_options_that_rewrite_kv_are_refused_by_name(llama):
    spec = SPECS["minmax-dense"]
    with pytest.raises(TypeError, match="EngineConfig.retrieval must be a RetrievalSpec"):
        EngineConfig(retrieval={"budget": 16})
    for option in (
        {"max_pages_per_request": 8},
        {"eviction": EvictionSpec("streaming_llm", budget=8)},
        {"speculative": SpeculativeConfig()},
    ):  # fmt: skip
        with pytest.raises(ValueError, match=f"retrieval does not combine with {next(iter(option))}"):
            EngineConfig(retrieval=spec, page_size=4, **option)
    with pytest.raises(ValueError, match=r"its page_size must be page_size \(4\), got 16"):
        EngineConfig(retrieval=RetrievalSpec(64), page_size=4)
    with pytest.raises(ValueError, match="pages='sequential' and dense_layers=0"):
        Engine(llama, retrieval=RetrievalSpec(16, page_size=4, pages="clustered"), **SMALL)


def test_serve_takes_a_retrieval_section_and_budget_flag(tmp_path, llama):
    """``jaxkv serve --retrieval-budget N`` (or a ``retrieval:`` section in the YAML): the engine's
    pages are the retrieval's, at the server's page size."""
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  page_size: 4\n  kv_memory: 64KiB\n  retrieval: {budget: 64, summary: centroid}\n")
    config = resolve_serve_config(build_parser().parse_args(["serve", "--config", str(path), "--retrieval-budget", "16"]))
    engine = Engine(llama, config.engine)
    assert engine.config.retrieval == RetrievalSpec(16, page_size=4, summary="centroid", prefill="dense")
    flags = build_parser().parse_args(["serve", "--config", str(path), "--page-size", "8"])
    assert resolve_serve_config(flags).engine.retrieval == RetrievalSpec(64, page_size=8, summary="centroid", prefill="dense")
    with pytest.raises(ValueError, match=r"its page_size must be page_size \(4\), got 8"):
        ServeConfig(engine={"page_size": 4, "retrieval": {"budget": 16, "page_size": 8}})
