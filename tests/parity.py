"""Teacher-forced parity with transformers: the scaffolding every model's parity test shares.

A tiny config is built and saved by transformers; the test loads it through our loader and
runs a ragged batch: a prefill, then single-token decode steps fed the same tokens. Every
step's logits must equal transformers' full-sequence logits at those positions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers


def save_tiny_hf_model(config, directory, vocab_size, prompt_lengths, decode_steps, *, perturb_norms=False, **kwargs):
    """Build a random transformers model from ``config``, save it to ``directory``, and
    return ``(sequences, expected_logits, hf_model)``: one random token sequence per prompt
    (prompt + ``decode_steps`` tokens) and HF's logits ``[L, V]`` over each whole sequence.

    ``perturb_norms``: transformers initialises some norm weights to a no-op (Gemma's 1 + w
    with w = 0); random values make the test exercise their loading. ``kwargs`` go to
    ``from_config`` (e.g. ``attn_implementation``)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()
    if perturb_norms:
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.5)
    hf.save_pretrained(directory)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, vocab_size, n + decode_steps) for n in prompt_lengths]
    with torch.no_grad():
        expected = [hf(torch.tensor(seq)[None]).logits[0].numpy() for seq in sequences]
    return sequences, expected, hf


def hf_early_exit_logits(hf, sequences, num_layers, softcap=None):
    """HF's logits ``[L, V]`` of each sequence from its first ``num_layers`` layers only: the
    hidden state after layer ``num_layers`` through the final norm and the LM head, then
    ``softcap * tanh(logits / softcap)`` when given (Gemma's final soft-cap)."""
    logits = []
    with torch.no_grad():
        for seq in sequences:
            hidden = hf.model(torch.tensor(seq)[None], output_hidden_states=True).hidden_states[num_layers]
            out = hf.lm_head(hf.model.norm(hidden))[0]
            logits.append((out if softcap is None else softcap * torch.tanh(out / softcap)).numpy())
    return logits


def check_teacher_forced(forward, cache, sequences, prompt_lengths, expected, decode_steps, label, atol=1e-4):
    """Prefill the ragged prompts, then ``decode_steps`` single tokens, through
    ``forward(tokens, positions, cache) -> (logits, cache)``, jitted (two compiles, where an
    eager scanned model traces its layer scan again at every step); assert every step's logits
    against ``expected``. Returns the final cache."""
    forward = jax.jit(lambda tokens, positions, cache, forward=forward: forward(tokens, positions, cache))
    width = max(prompt_lengths)
    tokens = np.zeros((len(prompt_lengths), width), np.int32)
    for row, n in enumerate(prompt_lengths):
        tokens[row, :n] = sequences[row][:n]
    cache = cache.reserve(width + decode_steps)
    logits, cache = forward(jnp.asarray(tokens), cache.next_positions(width, num_new=prompt_lengths), cache)
    for row, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(logits[row, :n], expected[row][:n], atol=atol, rtol=0, err_msg=label)
    for step in range(decode_steps):
        token = jnp.asarray([[seq[n + step]] for seq, n in zip(sequences, prompt_lengths)], jnp.int32)
        logits, cache = forward(token, cache.lengths[:, None], cache)
        for row, n in enumerate(prompt_lengths):
            np.testing.assert_allclose(
                logits[row, 0], expected[row][n + step], atol=atol, rtol=0, err_msg=f"{label} step {step}"
            )
    return cache


def hf_greedy(hf, prompts, max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids), one row at a time, with
    an explicit all-ones attention mask (a prompt may contain the pad id)."""
    continuations = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                **generate_kwargs,
            )  # fmt: skip
        continuations.append(out[0, len(prompt) :].tolist())
    return continuations
