"""jaxkv.models.tokenizer: the SmolLM2 GGUF tokenizer gives transformers' ids, text and chat prompts;
tiny GGUFs written here cover BOS insertion and the error paths."""

import os

import gguf
import jinja2
import pytest
import transformers

from jaxkv.models.defaults import resolve_model
from jaxkv.models.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "unicode": "héllo wörld — naïve café; 日本語のテキスト, Привет мир, 🚀🎉 emoji",
    "code": 'def square(x: int) -> int:\n    """Square."""\n    return x ** 2  # 10**6 == 1_000_000\n',
    "whitespace": "a   b\t\t c\n\n\n  d    \r\n   e   ",
    "leading-spaces": "    indented",
    "special": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "specials-glued": "x<file_sep>y<repo_name>z<|im_end|>",
    "empty": "",
}
SYSTEM_CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in one word."},
]


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_encode_decode_match_transformers(ours, reference, kind):
    text = TEXTS[kind]
    ids = ours.encode(text)
    assert ids == reference(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(ours):
    ids = ours.encode("<|im_start|>assistant\n<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:-1] == ours.encode("assistant\n")  # whole, not cut into '<', '|', ...
    assert ours.decode(ids) == "assistant\n"  # and skipped on decode by default


def test_digits_split_as_smollm2_pretokenizer(ours):
    # SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) isolate every number
    # character before the GPT-2 split, so a space run before a digit stays one piece and a space
    # never joins a number. (transformers' GGUF converter omits that step and gives
    # ['a', 'Ġ', 'Ġ', '1'] and ['ĠÂ', '²'] here.)
    def tokens(text):
        return [ours.backend.id_to_token(i) for i in ours.encode(text)]

    assert tokens("a  1") == ["a", "ĠĠ", "1"]
    assert tokens(" ²") == ["Ġ", "Â²"]
    assert tokens("x=123") == ["x", "=", "1", "2", "3"]


def test_special_ids_match_transformers(ours, reference):
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == [reference.eos_token_id] == [2]
    assert ours.vocab_size == len(reference) == 49152


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [SYSTEM_CHAT[1:2], SYSTEM_CHAT], ids=["one-turn", "multi-turn-system"])
def test_chat_template_matches_transformers(ours, reference, messages, add_generation_prompt):
    prompt = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert prompt.endswith("<|im_start|>assistant\n") == add_generation_prompt
    if messages[0]["role"] != "system":  # the template supplies SmolLM2's default system turn
        assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_from_file_roundtrips_a_saved_transformers_tokenizer(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    for text in [*TEXTS.values(), "a  1"]:  # the saved file carries transformers' own pre-tokenizer
        assert tok.encode(text) == reference(text)["input_ids"], text
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, [2])
    assert tok.apply_chat_template(SYSTEM_CHAT) == reference.apply_chat_template(
        SYSTEM_CHAT, tokenize=False, add_generation_prompt=True
    )


def test_from_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


# ---------------------------------------------------------------------------------------------
# Tiny tokenizer-only GGUFs

BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # printable ASCII spell themselves
TINY_TOKENS = ["<s>", "</s>", *BYTES, "Ġ", "he", "hel", "hell", "hello", "Ġw", "Ġwo"]
TINY_MERGES = ["h e", "he l", "hel l", "hell o", "Ġ w", "Ġw o"]


def write_tokenizer_gguf(path, *, model="gpt2", pre="gpt2", add_bos=False, template=None):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_merges(TINY_MERGES)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(TINY_TOKENS) - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_bpe_and_bos(tmp_path):
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", add_bos=True))
    hello, wo = TINY_TOKENS.index("hello"), TINY_TOKENS.index("Ġwo")
    assert tok.encode("hello wo") == [0, hello, wo]  # BOS, then merged pieces
    assert tok.encode("hello wo", add_special_tokens=False) == [hello, wo]
    assert tok.decode([0, hello, wo, 1]) == "hello wo"
    assert tok.encode("</s>hello") == [0, 1, hello]
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, [1])


def test_state_round_trip_gives_the_same_tokenizer(ours, tmp_path):
    """``state()`` is what the converted-weights cache stores; ``from_state`` must give the
    same ids, text, special tokens and chat prompts (BOS insertion and a template included)."""
    tiny = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", add_bos=True, template="{{ bos_token }}x"))
    for tokenizer in (ours, tiny):
        again = Tokenizer.from_state(tokenizer.state())
        for text in TEXTS.values():
            assert again.encode(text) == tokenizer.encode(text)
            assert again.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
        assert (again.bos_token_id, again.eos_token_ids, again.source) == (
            tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.source
        )
        assert again.apply_chat_template(SYSTEM_CHAT) == tokenizer.apply_chat_template(SYSTEM_CHAT)


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf"))
    assert tok.encode("hello") == [TINY_TOKENS.index("hello")]  # no BOS when the file says so
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_is_sandboxed_and_can_raise(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}"
    template += "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", template=template))
    # tojson must not HTML-escape (Jinja's own does), or prompts with code would change
    assert tok.apply_chat_template([{"role": "user", "content": "<a&b>"}]) == '<s>"<a&b>"'
    with pytest.raises(jinja2.TemplateError, match="first turn must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    evil = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "e.gguf", template="{{ ''.__class__.__mro__ }}"))
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([])


def test_unsupported_tokenizer_type_is_named(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "t5.gguf", model="t5")
    with pytest.raises(ValueError, match=r"tokenizer type 't5' is not supported yet; supported: \['gpt2', 'llama'\]"):
        Tokenizer.from_gguf(path)


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2' is not supported yet"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "q.gguf", pre="qwen2"))


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "x.gguf")
