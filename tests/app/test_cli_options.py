"""``jaxkv generate``'s cache options resolve to one validated config: one name per idea
(``--full-attention``, ``--quantization``, ``--kv-*``), the old ``--cache`` spelling still accepted
with a deprecation warning, and contradictions refused with a message naming the flag."""

from pathlib import Path

import pytest

from jaxkv.cli.generate import resolve_config
from jaxkv.cli.main import build_parser, main
from jaxkv.cli.serve import resolve_serve_config
from jaxkv.quantization import QuantSpec
from jaxkv.research.experiment import CacheChoice
from jaxkv.eviction import EvictionSpec
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.serving import Engine
from tests.cases import TINY_LLAMA


def resolved(*argv):
    return resolve_config(build_parser().parse_args(["generate", *argv]))


def test_defaults_are_static_full_precision():
    cache = resolved().cache
    assert cache.full_attention == "static" and cache.quantization is None


def test_full_attention_and_quantization_flags():
    assert resolved("--full-attention", "dynamic").cache.full_attention == "dynamic"
    cache = resolved("--quantization", "--kv-bits", "8", "--kv-axis-key", "-1").cache
    assert cache.quantization == QuantSpec(nbits=8, axis_key=-1)
    assert cache.quantization.bits == 8


def test_kv_options_without_quantization_name_the_flag():
    with pytest.raises(ValueError, match="--quantization"):
        resolved("--kv-bits", "8")


@pytest.mark.parametrize(
    ("old", "full_attention", "quantized", "replacement"),
    [("static", "static", False, "--full-attention static"), ("dynamic", "dynamic", False, "--full-attention dynamic"),
     ("quantized", "static", True, "--quantization")],
)  # fmt: skip
def test_deprecated_cache_flag_still_works_and_says_what_replaces_it(capsys, old, full_attention, quantized, replacement):
    cache = resolved("--cache", old).cache
    assert cache.full_attention == full_attention and (cache.quantization is not None) == quantized
    err = capsys.readouterr().err
    assert "deprecated" in err and replacement in err


def test_config_file_quantization_can_be_turned_off_by_the_old_flag(tmp_path):
    config = tmp_path / "int4.yaml"
    config.write_text("cache:\n  quantization:\n    nbits: 4\n")
    assert resolved("--config", str(config)).cache.quantization is not None
    assert resolved("--config", str(config), "--cache", "static").cache.quantization is None


def test_serve_config_file_and_flags():
    """``jaxkv serve --config``: the YAML validated, flags on top; a typo names the key and the file."""
    parse = build_parser().parse_args
    path = Path(__file__).resolve().parents[2] / "configs" / "serve.yaml"
    config = resolve_serve_config(parse(["serve", "--config", str(path), "--port", "9001"]))
    engine = config.engine
    assert (config.model, engine.kv_memory, config.port, engine.prefix_caching) == ("smollm2", "512MiB", 9001, True)
    off = resolve_serve_config(parse(["serve", "--no-prefix-caching"]))
    assert off.engine.prefix_caching is False and off.host == "127.0.0.1"


def test_a_serve_config_in_the_old_flat_layout_still_loads_with_a_warning(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: smollm2\nkv_memory: 2MiB\npage_size: 8\nengine: {max_num_seqs: 4}\n")
    with pytest.warns(DeprecationWarning, match="kv_memory, page_size belong in the engine: section"):
        served = resolve_serve_config(build_parser().parse_args(["serve", "--config", str(config)]))
    assert (served.engine.kv_memory, served.engine.page_size, served.engine.max_num_seqs) == ("2MiB", 8, 4)


def test_serve_config_typo_is_named(tmp_path, capsys):
    bad = tmp_path / "serve.yaml"
    bad.write_text("model: smollm2\nengine: {max_num_seq: 8}\n")
    with pytest.raises(ValueError, match="max_num_seq"):
        resolve_serve_config(build_parser().parse_args(["serve", "--config", str(bad)]))
    assert main(["serve", "--config", str(bad)]) == 2
    assert "max_num_seq" in capsys.readouterr().err


def test_serve_config_eviction(tmp_path):
    """``eviction:`` in the serve config reaches the engine as its ``EvictionSpec``; it needs
    prefix caching off (an error naming the fix), and exactly one of budget and compression_ratio."""
    config = tmp_path / "serve.yaml"
    config.write_text("engine:\n  eviction: {policy: snapkv, budget: 32, window: 8}\n  prefix_caching: false\n"
                      "  kv_memory: 1MiB\n")  # fmt: skip
    served = resolve_serve_config(build_parser().parse_args(["serve", "--config", str(config)]))
    engine = Engine(Llama(LlamaConfig(**TINY_LLAMA)), served.engine)
    assert engine.config.eviction == EvictionSpec("snapkv", budget=32, window=8)
    assert not engine.config.prefix_caching and engine.sizes.state_bytes > 0
    config.write_text("engine: {eviction: {policy: snapkv, budget: 32}}\n")  # prefix caching on, the default
    with pytest.raises(ValueError, match="prefix caching cannot share.*prefix_caching: false"):
        resolve_serve_config(build_parser().parse_args(["serve", "--config", str(config)]))
    config.write_text("engine: {eviction: {policy: h2o}, prefix_caching: false}\n")
    with pytest.raises(ValueError, match="eviction.*exactly one of budget"):
        resolve_serve_config(build_parser().parse_args(["serve", "--config", str(config)]))


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["serve", "--compaction-policy", "tova"], "compaction_policy"),  # without --max-pages-per-request
        (["serve", "--disk-kv-memory", "lots"], "disk_kv_memory"),  # without --kv-cache-dir
        (["serve", "--host-kv-memory", "-1"], "host_kv_memory"),
        (["serve", "--kv-memory", "0"], "kv_memory"),
        (["generate", "--top-p", "5"], "top_p"),  # greedy: top_p unused, still checked
        (["generate", "--min-p", "-1"], "min_p"),
    ],
)
def test_settings_used_only_beside_others_are_checked_on_their_own(argv, named):
    """A setting is checked when the config is resolved, before any model loads, whether or not
    the option that uses it is set."""
    resolve = resolve_serve_config if argv[0] == "serve" else resolve_config
    with pytest.raises(ValueError, match=named):
        resolve(build_parser().parse_args(argv))


def test_eviction_sections_check_their_policy_options():
    with pytest.raises(ValueError, match="kernel_size must be a positive odd number"):
        CacheChoice(name="snapkv", eviction={"policy": "snapkv", "kernel_size": 4})
    with pytest.raises(ValueError, match="beta"):
        CacheChoice(name="pyramid", eviction={"policy": "pyramidkv", "beta": 0.5})
    with pytest.raises(ValueError, match="budgets: drop budget"):
        CacheChoice(name="h2o", eviction={"policy": "h2o", "budget": 8})
