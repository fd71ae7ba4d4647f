"""``jaxkv serve --speculative-method draft --speculative-draft-model smollm2``: the draft model is loaded as
the model is (SmolLM2-135M drafting for itself), and greedy completions equal ``generate``'s with
its drafts counted in the response and ``/metrics``."""

import openai

from tests.server.conftest import MODEL, SERVER_ARGS
from tests.server.test_server import metric, reference  # noqa: F401 - the fixture: generate's greedy text

# Every draft verified: a draft as large as its target never pays, so the measured rule would stop drafting.
SERVER_ARGS = (
    *SERVER_ARGS, "--speculative-method", "draft", "--speculative-draft-model", MODEL, "--speculative-num-tokens", "3",
    "--speculative-always-verify",
)  # fmt: skip


def test_a_draft_model_drafts_and_the_text_is_generates(server, reference):  # noqa: F811
    tokenizer, greedy = reference
    client = openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = ["The three primary colors are", "Once upon a time, in a small village,"]
    texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0) for p in prompts]
    assert [t.choices[0].text for t in texts] == greedy([tokenizer.encode(p) for p in prompts], 24)
    counted = [t.model_extra["speculation"] for t in texts]
    assert all(c["proposed"] > 0 and c["accepted"] > 0 for c in counted), (counted, texts)  # drafting for itself
    assert metric(server[1], "jaxkv_speculative_proposed_tokens_total") == sum(c["proposed"] for c in counted)
