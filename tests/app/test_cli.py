"""``jaxkv generate`` end to end, and each kind of bad input giving a clear error; ``jaxkv
tokenizer``'s directory loads in transformers as the same tokenizer."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cli.main import main
from jaxkv.decoding.generate import generate
from jaxkv.decoding.sampling import Sampling, sample
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.load import Pretrained

TINY = LlamaConfig(
    vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_smollm2_prints_text_and_timings(capsys):
    code, out, err = run(capsys, "generate", "--model", "smollm2", "--prompt", "What is 2+2?", "--max-new-tokens", "8")
    assert code == 0, err
    assert out.strip()
    assert "decode" in err and "tok/s" in err and "compile" in err and "cache" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "no-such-model"], "known"),
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--top-p", "0"], "top_p"),
    ],
)
def test_bad_arguments_are_clear_errors(capsys, argv, message):
    code, _, err = run(capsys, "generate", *argv)
    assert code == 2
    assert message in err


def test_config_typo_names_key_and_file(capsys, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("model: smollm2\nmax_new_tokenz: 5\n")
    code, _, err = run(capsys, "generate", "--config", str(config))
    assert code == 2
    assert "typo.yaml" in err and "max_new_tokenz" in err


def test_tokenizer_writes_a_directory_transformers_loads_as_the_same_tokenizer(capsys, tmp_path):
    """``jaxkv tokenizer``: transformers' ``AutoTokenizer`` loads the directory it writes,
    encodes a sentence to jaxkv's ids, and has the model's special tokens and chat template,
    rendering a conversation as jaxkv does."""
    import transformers

    out = tmp_path / "smollm2-tokenizer"
    code, printed, err = run(capsys, "tokenizer", "--model", "smollm2", "--out", str(out))
    assert code == 0, err
    assert printed.split() == [str(out / "tokenizer.json"), str(out / "tokenizer_config.json")]
    ours, theirs = Pretrained("smollm2").tokenizer(required=True), transformers.AutoTokenizer.from_pretrained(out)
    sentence = "A KV cache keeps each token's keys and values: 3.14159 tokens, café, 🚀!"
    assert theirs(sentence)["input_ids"] == ours.encode(sentence)
    assert (theirs.bos_token, theirs.eos_token) == (ours.bos_token, ours.eos_tokens[0])
    assert theirs.chat_template == ours.chat_template is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(messages)


def test_tokenizer_bad_arguments_are_clear_errors(capsys, tmp_path):
    """An unknown ``--model``, an ``--out`` that is a file: exit status 2 and a message naming the argument."""
    file = tmp_path / "a-file"
    file.write_text("")
    cases = [(["--model", "no-such-model", "--out", str(tmp_path / "out")], "--model no-such-model: "),
             (["--out", str(file)], f"--out {file} exists and is not a directory")]  # fmt: skip
    for argv, message in cases:
        code, _, err = run(capsys, "tokenizer", *argv)
        assert code == 2 and message in err, err


def test_prompt_too_long_is_refused_before_compiling():
    model = Llama(TINY)
    with pytest.raises(ValueError, match="cannot fit"):
        generate(model, [list(range(40))], max_new_tokens=4, max_length=32)
    with pytest.raises(ValueError, match="cannot fit"):
        generate(model, [[1] * 70], max_new_tokens=4)  # past max_position_embeddings
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        generate(model, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], max_new_tokens=3)


def test_sampling_filters():
    """top-k, top-p and min-p only ever pick tokens their rule admits; temperature 0 is argmax."""
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 256))
    keys = jax.random.split(jax.random.key(0), 4)
    assert set(np.asarray(sample(logits, keys[0], Sampling())).tolist()) == {0}
    assert set(np.asarray(sample(logits, keys[1], Sampling(1.0, top_k=2))).tolist()) == {0, 1}
    assert set(np.asarray(sample(logits, keys[2], Sampling(1.0, top_p=0.7))).tolist()) == {0, 1}
    assert set(np.asarray(sample(logits, keys[3], Sampling(1.0, min_p=0.25))).tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="invalid sampling"):
        Sampling(temperature=-1)


def test_sampled_generation_is_seeded_and_stops_per_row():
    model = Llama(TINY, seed=3)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    one = generate(model, prompts, max_new_tokens=12, sampling=Sampling(0.9, top_k=10), seed=5)
    two = generate(model, prompts, max_new_tokens=12, sampling=Sampling(0.9, top_k=10), seed=5)
    np.testing.assert_array_equal(one.tokens, two.tokens)
    stop = one.row(0)[2]
    stopped = generate(model, prompts, max_new_tokens=12, sampling=Sampling(0.9, top_k=10), seed=5, stop_tokens=[stop])
    assert stopped.row(0) == one.row(0)[: one.row(0).index(stop) + 1]
    assert stopped.finish[0].name == "STOP_TOKEN"


def test_capacity_stops_a_row_with_a_reason():
    model = Llama(TINY)
    result = generate(model, [[1] * 10, [2] * 3], max_new_tokens=30, max_length=16)
    assert [f.name for f in result.finish] == ["CAPACITY", "CAPACITY"]
    # Every stored token fits; the last generated one is returned but never fed back.
    np.testing.assert_array_equal(result.num_generated, [16 - 10 + 1, 16 - 3 + 1])


def test_prompt_lengths_share_compiled_code_within_a_bucket():
    """A new prompt length in a seen bucket (and a new batch content) compiles nothing."""
    model = Llama(TINY, seed=4)
    first = generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=6)
    again = generate(model, [[9, 8, 7, 6, 5, 4, 3, 2, 1]], max_new_tokens=6)
    assert first.compile_seconds > 0
    assert again.compile_seconds == 0
    other_bucket = generate(model, [list(range(1, 20))], max_new_tokens=6)
    assert other_bucket.compile_seconds > 0


def test_compiled_executables_are_reused_and_bounded(monkeypatch):
    """The decoding driver's executable cache: a seen shape compiles nothing, and only the most
    recently used ``MAX_COMPILED`` executables stay alive."""
    driver = importlib.import_module("jaxkv.decoding.driver")

    monkeypatch.setattr(driver, "_COMPILED", driver.collections.OrderedDict())
    monkeypatch.setattr(driver, "MAX_COMPILED", 2)
    double = jax.jit(lambda x: 2 * x)
    seconds = [driver.compiled(double, {}, jnp.zeros(n))[1] for n in (1, 2, 1, 3)]
    assert seconds[0] > 0 and seconds[1] > 0 and seconds[2] == 0 and seconds[3] > 0
    assert [key[2][0][0] for key in driver._COMPILED] == [(1,), (3,)]  # (2,) was least recent
    executable, again = driver.compiled(double, {}, jnp.zeros(2))
    assert again > 0 and float(executable(jnp.ones(2))[1]) == 2.0
