"""The converted-weights cache (jaxkv.models.weight_cache via jaxkv.models.load; the dense conversion,
``weights="dense"``: the kept blocks' cache is in test_kept_weights.py): a GGUF is converted
once and read back after; damaged cache files are rebuilt, never used; XDG_CACHE_HOME, the
source's content and --no-cache / use_weight_cache=False decide what is read. Also the CLI's
prompt form for a model without a chat template, decided before its weights load."""

import hashlib
import os
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import persist
from jaxkv.cli.main import main
from jaxkv.models import load
from jaxkv.models.llama import Llama
from jaxkv.models.load import Pretrained, load_pretrained
from jaxkv.models.weight_cache import cache_dir, file_sha256, read_checked, write_checked
from jaxkv.models.weights import load_gguf
from jaxkv.persist import weights_fingerprint
from tests.models.test_tokenizer import TINY_MERGES, TINY_TOKENS

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 2, 16, 32, 2, 1, 8
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_tiny_gguf(path, *, seed: int = 0, template: str | None = None, bump: str | None = None):
    """A llama-architecture GGUF with random float32 weights and a byte-level BPE tokenizer;
    ``bump``: a tensor whose last value is 0.5 more."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [(writer.add_block_count, LAYERS), (writer.add_context_length, 64),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_tokenizer_model, "gpt2"),
                       (writer.add_tokenizer_pre, "gpt2"), (writer.add_token_list, TINY_TOKENS),
                       (writer.add_token_merges, TINY_MERGES), (writer.add_bos_token_id, 0),
                       (writer.add_eos_token_id, 1)]:  # fmt: skip
        add(value)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(TINY_TOKENS) - 2))
    if template is not None:
        writer.add_chat_template(template)
    shapes = {"token_embd.weight": (len(TINY_TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.attn_q.weight": (q, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv, HIDDEN), f"blk.{i}.attn_v.weight": (kv, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, q), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }  # fmt: skip
    for name, shape in shapes.items():
        tensor = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        tensor.reshape(-1)[-1] += 0.5 if name == bump else 0
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def weights(model) -> dict[str, np.ndarray]:
    """A model's arrays by their path in its state."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def assert_same_weights(model, expected):
    actual, wanted = weights(model), weights(expected)
    assert actual.keys() == wanted.keys()
    for name in wanted:
        np.testing.assert_array_equal(actual[name], wanted[name], err_msg=name)


def replace_contents(path, data: bytes) -> None:
    """Damage a cache file as another writer would: a new file renamed over it. (Writing it in
    place would pull the pages from under an earlier load's arrays, which map the file.)"""
    other = path.with_name(path.name + ".other")
    other.write_bytes(data)
    os.replace(other, path)


def cached_files(kind: str = "*") -> list:
    return sorted((cache_dir() / "converted").glob(f"*.{kind}.safetensors"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test here caches under its own XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "jaxkv"


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf", template=TEMPLATE)


def no_conversion(monkeypatch):
    """From here on, converting (or even opening) a GGUF fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was read again instead of its cached conversion")

    monkeypatch.setattr(load, "load_gguf", refuse)
    monkeypatch.setattr(load, "open_gguf", refuse)


def test_first_load_converts_and_caches_the_second_reads_the_cache(tiny_gguf, monkeypatch, capsys, private_cache):
    model, tokenizer = load_pretrained(tiny_gguf, weights="dense")
    err = capsys.readouterr().err
    assert f"jaxkv: converting tiny.gguf; the result is cached in {private_cache / 'converted'}\n" in err
    assert "20/20 [" in err  # the progress bar over its tensors
    written = sorted(path.name.split(".")[1] for path in (private_cache / "converted").iterdir())
    assert written == ["tokenizer", "weights"]

    no_conversion(monkeypatch)
    again, tokenizer_again = load_pretrained(tiny_gguf, weights="dense")
    assert "converting" not in capsys.readouterr().err
    assert_same_weights(again, model)
    assert_same_weights(again, Llama(*load_gguf(tiny_gguf)))  # and both equal a direct conversion
    assert again.config == model.config
    for text in ["hello wo", "</s>hello", ""]:
        assert tokenizer_again.encode(text) == tokenizer.encode(text)
    assert (tokenizer_again.chat_template, tokenizer_again.eos_tokens) == (tokenizer.chat_template, ["</s>"])


def test_other_dtypes_cast_from_the_float32_cache(tiny_gguf, monkeypatch):
    full = Pretrained(tiny_gguf).model(weights="dense")
    no_conversion(monkeypatch)
    half = Pretrained(tiny_gguf).model(jnp.bfloat16, weights="dense")
    assert {leaf.dtype for leaf in weights(half).values()} == {jnp.dtype(jnp.bfloat16)}
    for name, array in weights(full).items():
        expected = np.asarray(jnp.asarray(array, jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(weights(half)[name].astype(np.float32), expected, err_msg=name)
    assert len(cached_files("weights")) == 1


def test_the_weights_fingerprint_is_kept_with_the_conversion(tiny_gguf, tmp_path, monkeypatch):
    """A warm load's fingerprint comes from the cache (no weight is hashed) and equals the cold
    load's; another dtype, or a file differing in its last layer's last value, has another."""
    cold = weights_fingerprint(Pretrained(tiny_gguf).model(weights="dense"))
    other_file = write_tiny_gguf(tmp_path / "other.gguf", template=TEMPLATE, bump=f"blk.{LAYERS - 1}.ffn_down.weight")
    other = weights_fingerprint(Pretrained(other_file).model(weights="dense"))
    no_conversion(monkeypatch)
    monkeypatch.setattr(persist, "arrays_digest", lambda named: pytest.fail("a warm load hashed the weights"))
    assert weights_fingerprint(Pretrained(tiny_gguf).model(weights="dense")) == cold
    assert len({cold, other, weights_fingerprint(Pretrained(tiny_gguf).model(jnp.bfloat16, weights="dense"))}) == 3


def damage_truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def damage_flip_a_byte(data: bytes) -> bytes:  # a weights file still parses: the last tensor's bytes
    return data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:]


def damage_garbage(data: bytes) -> bytes:
    return os.urandom(len(data))


def damage_empty(data: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("kind", ["weights", "tokenizer"])
@pytest.mark.parametrize("damage", [damage_truncate, damage_flip_a_byte, damage_garbage, damage_empty])
def test_a_damaged_cache_file_is_rebuilt_never_used(tiny_gguf, kind, damage):
    model, tokenizer = load_pretrained(tiny_gguf, weights="dense")
    [path] = cached_files(kind)
    tensors, metadata = read_checked(path)
    replace_contents(path, damage(path.read_bytes()))
    with pytest.warns(UserWarning, match=f"cached file .*{kind}.* converting again"):
        again, tokenizer_again = load_pretrained(tiny_gguf, weights="dense")
    assert_same_weights(again, model)
    assert tokenizer_again.encode("hello wo") == tokenizer.encode("hello wo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt file reads back cleanly, as it was
        tensors_again, metadata_again = read_checked(path)
    assert metadata_again == metadata and tensors_again.keys() == tensors.keys()
    for name in tensors:
        np.testing.assert_array_equal(tensors_again[name], tensors[name])


def test_checksum_covers_metadata(tmp_path):
    path = tmp_path / "entry.safetensors"
    write_checked(path, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"config": '{"a": 1}'})
    tensors, metadata = read_checked(path)
    np.testing.assert_array_equal(tensors["x"], np.arange(6).reshape(2, 3))
    assert metadata == {"config": '{"a": 1}'}
    replace_contents(path, path.read_bytes().replace(b'{\\"a\\": 1}', b'{\\"a\\": 2}'))
    with pytest.warns(UserWarning, match="fails its checksum"):
        assert read_checked(path) is None
    assert not path.exists()  # deleted, so the caller's rewrite starts clean


def test_xdg_cache_home_is_honoured(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere" / "jaxkv"
    load_pretrained(tiny_gguf, weights="dense")
    assert len(list((tmp_path / "elsewhere" / "jaxkv" / "converted").iterdir())) == 2
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ["", "relative/cache"]:  # the XDG spec: empty or relative means the default
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert cache_dir() == tmp_path / "home" / ".cache" / "jaxkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "jaxkv"


def test_use_weight_cache_false_neither_reads_nor_writes(tiny_gguf, private_cache, capsys):
    model, _ = load_pretrained(tiny_gguf, use_weight_cache=False, weights="dense")
    assert not private_cache.exists()
    load_pretrained(tiny_gguf, weights="dense")
    [path] = cached_files("weights")
    replace_contents(path, b"damaged")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the damaged file is not even looked at
        again, _ = load_pretrained(tiny_gguf, use_weight_cache=False, weights="dense")
    assert path.read_bytes() == b"damaged"
    assert_same_weights(again, model)
    assert "jaxkv: converting tiny.gguf\n" in capsys.readouterr().err


def test_cli_no_cache_flag(tiny_gguf, private_cache, capsys):
    argv = ["generate", "--model", str(tiny_gguf), "--prompt", "hello", "--max-new-tokens", "2", "--no-cache"]
    assert main(argv) == 0, capsys.readouterr().err
    assert not private_cache.exists()
    assert main(argv[:-1]) == 0
    assert len(cached_files()) == 2


def test_the_key_follows_the_source_content(tiny_gguf, monkeypatch):
    first = Pretrained(tiny_gguf).model(weights="dense")
    stat = tiny_gguf.stat()
    write_tiny_gguf(tiny_gguf, seed=1, template=TEMPLATE)  # same size, other weights
    assert tiny_gguf.stat().st_size == stat.st_size
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = Pretrained(tiny_gguf).model(weights="dense")
    assert len(cached_files("weights")) == 2
    assert_same_weights(second, Llama(*load_gguf(tiny_gguf)))
    assert not np.array_equal(weights(first)["['embed'].value"], weights(second)["['embed'].value"])


def test_digest_is_hashed_once_per_version_of_the_file(tiny_gguf, monkeypatch):
    hashed, real_digest = [], hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda *args: hashed.append(args) or real_digest(*args))
    digest = file_sha256(tiny_gguf)
    assert digest == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest() and len(hashed) == 1
    assert file_sha256(tiny_gguf) == digest and len(hashed) == 1  # remembered
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert file_sha256(tiny_gguf) == digest and len(hashed) == 2  # touched: hashed again
    copy = tiny_gguf.with_name("copy.gguf")  # another file of the same size and mtime (cp -p)
    copy.write_bytes(tiny_gguf.read_bytes())
    os.utime(copy, ns=(stat.st_atime_ns, tiny_gguf.stat().st_mtime_ns))
    os.replace(copy, tiny_gguf)
    assert file_sha256(tiny_gguf) == digest and len(hashed) == 3


def test_an_unwritable_cache_warns_and_loads(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.warns(UserWarning, match="cannot write the cache file"):
        model, tokenizer = load_pretrained(tiny_gguf, weights="dense")
    assert_same_weights(model, Llama(*load_gguf(tiny_gguf)))
    assert tokenizer.encode("hello") == [TINY_TOKENS.index("hello")]


# ---------------------------------------------------------------------------------------------
# A model without a chat template: plain-text prompt, decided before the weights load


def test_generate_without_a_chat_template_uses_the_prompt_as_text(tmp_path, monkeypatch, capsys):
    path = write_tiny_gguf(tmp_path / "base.gguf")  # no template, as the embedded Gemma 3
    said_before_weights = []
    real_model = Pretrained.model

    def model(self, *args, **kwargs):
        said_before_weights.append(capsys.readouterr().err)
        return real_model(self, *args, **kwargs)

    monkeypatch.setattr(Pretrained, "model", model)
    code = main(["generate", "--model", str(path), "--prompt", "hello", "--max-new-tokens", "2"])
    assert code == 0, capsys.readouterr().err
    [err] = said_before_weights
    assert "base.gguf has no chat template: the prompt is plain text (--no-chat)" in err
    assert "tok/s" in capsys.readouterr().err  # the timing line: it generated
    # A multi-turn chat cannot do without one: said before the weights load, too.
    monkeypatch.setattr("sys.stdin", iter(["hi\n"]))
    assert main(["chat", "--model", str(path)]) == 2
    assert "has no chat template, which chat needs; try jaxkv generate --no-chat" in capsys.readouterr().err
    assert len(said_before_weights) == 1


def test_gemma3_generate_is_plain_text_before_its_weights_load(monkeypatch, capsys):
    """The embedded Gemma 3 GGUF (a base model) has no chat template; the user's default cache
    is used, so that only a first run parses its 262k-token vocabulary."""
    monkeypatch.undo()  # the user's cache, not this file's private one

    class WeightsLoad(Exception):
        pass

    def model(self, *args, **kwargs):
        raise WeightsLoad(capsys.readouterr().err)

    monkeypatch.setattr(Pretrained, "model", model)
    with pytest.raises(WeightsLoad, match=r"gemma3 has no chat template: the prompt is plain text \(--no-chat\)"):
        main(["generate", "--model", "gemma3", "--prompt", "What is a KV cache?"])
