"""Speculative decoding on real weights: Gemma 3 270M decodes a 600+ token prompt past its
512-token window with prompt lookup and equals plain greedy. Its own file, so that it compiles
with full optimization (``OPTIMIZED_FILES`` in tests/conftest.py: real weights, many tokens);
the tiny models' cases are in test_speculative.py.
"""

from jaxkv.models.load import load_pretrained

from jaxkv.decoding.generate import generate
from jaxkv.decoding.speculative import PromptLookup, generate_speculative
from tests.cases import PARAGRAPH


def test_real_gemma3_prompt_lookup_past_the_window_equals_plain_greedy():
    """Gemma 3 270M, a 600+ token prompt: the sliding layers' 512-token rings (plus k
    rollback slots) wrap during prefill and decode while rounds roll back."""
    model, tokenizer = load_pretrained("gemma3")
    prompt = tokenizer.encode(PARAGRAPH * 7 + "In summary, the printing press")
    assert len(prompt) > 600
    # The same ring sizes (512 + 4 rollback slots) for both, so the prefill compiles once.
    plain = generate(model, [prompt], max_new_tokens=32, rollback_slots=4)
    result = generate_speculative(model, [prompt], drafter=PromptLookup(), num_draft_tokens=4, max_new_tokens=32)
    assert result.row(0) == plain.row(0)
    assert result.tokens_per_step > 1
