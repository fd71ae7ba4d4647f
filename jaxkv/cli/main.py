"""``jaxkv generate``: text from a real model through a jaxkv cache, with timings.

    jaxkv generate --model smollm2 --prompt "What is a KV cache?" --max-new-tokens 64
    jaxkv generate --config configs/smollm2.yaml --stream
    jaxkv generate --num-beams 4 --num-return-sequences 2 --early-stopping true
    jaxkv generate --full-attention dynamic --quantization --kv-bits 8
    jaxkv generate --offload        (full-attention K/V in host memory; --offload all, --offload 0,1,2)
    jaxkv generate --mesh data=2,model=4 --prompt "One" --prompt "Two"   (sharded over 8 devices)
    jaxkv launch --num-processes 2 --devices-per-process 4 -- generate --mesh data=2,model=4 ...
    jaxkv chat --system "Be brief." --save-cache chat.safetensors   (one message per stdin line)
    jaxkv bench serving --quick        (jaxkv bench decode|serving: the benchmarks, --help lists their options)
    jaxkv experiment configs/experiments/smoke.yaml [...] [--dry-run]   (grids of model x task x cache x budget)

The decode benchmark is a script of the source checkout: ``python scripts/bench_decode.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from jaxkv.cli import launch
from jaxkv.config import (
    BudgetedEvictionConfig, CacheConfig, MeshConfig, QuantizationConfig, RetrievalConfig, Strict, load_config,
)  # fmt: skip
from jaxkv.cli.launch import Distributed
from jaxkv.kernels import BACKENDS

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxkv.serving import Engine, EngineConfig


class GenerateConfig(Strict):
    """What ``jaxkv generate`` runs; a YAML file under configs/ sets any of these."""

    model: str = "smollm2"
    prompt: str | Annotated[list[str], Field(min_length=1)] = "What is a KV cache, in two sentences?"  # list: a batch
    chat: bool = True
    max_new_tokens: PositiveInt = 64
    dtype: Literal["float32", "bfloat16"] = "float32"
    cache: CacheConfig = CacheConfig()
    temperature: NonNegativeFloat = 0.0
    top_k: NonNegativeInt = 0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0  # checked even when greedy (temperature 0) ignores it
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int = 0
    speculative: Literal["prompt_lookup", "draft", "self"] | None = None  # see jaxkv.decoding.speculative
    num_draft_tokens: PositiveInt = 4
    draft_model: str | None = None  # --speculative draft: a model with the same vocabulary
    exit_layer: PositiveInt | None = None  # --speculative self: layers that draft
    num_beams: PositiveInt = 1  # > 1: beam search (jaxkv.decoding.beam), transformers' semantics
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    num_return_sequences: PositiveInt = 1
    mesh: MeshConfig | None = None  # shard the model and the cache over the devices (one prompt per data row)
    attention_backend: Literal[BACKENDS] = "xla"  # reads static full-attention decodes (docs/kernels.md)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @model_validator(mode="after")
    def beams_are_deterministic(self):
        if self.num_beams > 1 and (self.temperature > 0 or self.speculative is not None):
            raise ValueError("num_beams > 1 is deterministic beam search: drop temperature / speculative")
        if self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences {self.num_return_sequences} exceeds num_beams {self.num_beams}")
        return self

    @model_validator(mode="after")
    def speculative_needs_its_model(self):
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative 'draft' needs draft_model (--draft-model NAME_OR_PATH)")
        if self.speculative == "self" and self.exit_layer is None:
            raise ValueError("speculative 'self' needs exit_layer (--exit-layer N: the first N layers draft)")
        return self


NO_CACHE_HELP = "convert a GGUF again: neither read nor write its converted weights under $XDG_CACHE_HOME/jaxkv"


def _generate_parser(sub) -> None:
    parser = sub.add_parser("generate", help="generate text with a model")
    parser.add_argument("--config", type=Path, help="YAML file (configs/*.yaml); flags below override it")
    parser.add_argument(
        "--model", help="embedded default name (smollm2, gemma3), a checkpoint directory or a .gguf file"
    )
    parser.add_argument(
        "--prompt", action="append", help="the prompt; give it again for more prompts, decoded as one batch"
    )
    parser.add_argument("--no-chat", dest="chat", action="store_false", default=None, help="no chat template")
    parser.add_argument("--no-cache", dest="weight_cache", action="store_false", help=NO_CACHE_HELP)
    parser.add_argument(
        "--full-attention", choices=["static", "dynamic"], help="storage of full-attention layers (default static)"
    )
    parser.add_argument(
        "--quantization", action="store_true", default=None, help="store K/V quantized (static; tune with --kv-*)"
    )
    parser.add_argument("--cache", choices=["static", "dynamic", "quantized"], help=argparse.SUPPRESS)  # deprecated
    parser.add_argument(
        "--offload", nargs="?", const=True, type=offload_flag, metavar="LAYERS",
        help="K/V of these layers in host memory, one layer on the device at a time: alone, the full-attention "
        "layers; 'all'; or comma-separated layer types and indices",
    )  # fmt: skip
    quant = parser.add_argument_group("quantized cache (--quantization; defaults: the reference's)")
    for flag, key, kind, help_text in QUANT_FLAGS:
        quant.add_argument(flag, dest=f"kv_{key}", type=kind, help=help_text)
    parser.add_argument("--max-length", type=int, help="cache capacity in tokens (default: prompt + new, bucketed)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    beams = parser.add_argument_group("beam search (--num-beams > 1)")
    beams.add_argument("--num-beams", type=int, help="beams kept per prompt (default 1: no beam search)")
    beams.add_argument("--length-penalty", type=float, help="score = log p / length ** penalty (default 1)")
    beams.add_argument(
        "--early-stopping", choices=["true", "false", "never"], help="transformers' semantics (default false)"
    )
    beams.add_argument("--num-return-sequences", type=int, help="best hypotheses printed (default 1)")
    parser.add_argument(
        "--attention-backend", choices=BACKENDS, help="what reads the static full-attention layers' decode tokens: "
        "xla (default), pallas_gpu (Pallas' GPU decode kernel), pallas_tpu (xla: no dense TPU kernel), or auto "
        "(the platform's kernel, else xla); docs/kernels.md"
    )
    spec = parser.add_argument_group("speculative decoding (greedy output unchanged)")
    spec.add_argument("--speculative", choices=["prompt_lookup", "draft", "self"], help="how drafts are made")
    spec.add_argument("--num-draft-tokens", type=int, help="drafts verified per target pass (default 4)")
    spec.add_argument("--draft-model", help="--speculative draft: a smaller model with the same vocabulary")
    spec.add_argument("--exit-layer", type=int, help="--speculative self: the first N layers draft")
    parser.add_argument("--mesh", help=MESH_HELP + "; the number of prompts must be a multiple of data")
    launch.add_distributed_flags(parser)


MESH_HELP = (
    "shard over a device mesh, e.g. data=2,model=4 (batch rows over data; heads, MLP and vocabulary over model); "
    "the sizes multiply to the device count"
)


# Flag, QuantizationConfig field, type, help.
QUANT_FLAGS = (
    ("--kv-bits", "nbits", int, "2, 4 or 8 (int; default 4); fp8 formats are 8"),
    ("--kv-format", "format", str, "int, e4m3 or e5m2"),
    ("--kv-axis-key", "axis_key", int, "0 per token, -1 per channel"),
    ("--kv-axis-value", "axis_value", int, "0 per token, -1 per channel"),
    ("--kv-group-size", "q_group_size", int, "values per scale group (default 64)"),
    ("--kv-residual", "residual_length", int, "recent tokens kept in full precision (default 128)"),
)


def resolve_config(args) -> GenerateConfig:
    """The YAML config (if any) with the command-line flags on top, validated as a whole."""
    merged = (load_config(args.config, GenerateConfig) if args.config else GenerateConfig()).model_dump()
    for key in (
        "model", "prompt", "chat", "max_new_tokens", "dtype", "temperature", "top_k", "top_p", "min_p", "seed",
        "speculative", "num_draft_tokens", "draft_model", "exit_layer", "num_beams", "length_penalty",
        "num_return_sequences", "attention_backend",
    ):  # fmt: skip
        if getattr(args, key) is not None:
            merged[key] = getattr(args, key)
    if args.early_stopping is not None:
        merged["early_stopping"] = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    merged["cache"] = cache_settings(args, merged["cache"])
    return GenerateConfig.model_validate(merged | mesh_setting(args))


def mesh_setting(args) -> dict:
    """``{"mesh": ...}`` from ``--mesh`` (it replaces the config's), or nothing."""
    return {} if args.mesh is None else {"mesh": MeshConfig.parse(args.mesh).model_dump()}


def offload_flag(text: str) -> str | list[str | int]:
    """``--offload``'s value: ``all``, or comma-separated layer types and layer indices."""
    if text == "all":
        return text
    return [int(item) if item.strip().isdigit() else item.strip() for item in text.split(",") if item.strip()]


def cache_settings(args, cache: dict) -> dict:
    """The config's ``cache`` section with ``--full-attention``, ``--quantization``, ``--kv-*``,
    ``--offload`` and ``--max-length`` on top (``--cache`` is the deprecated spelling of the first two)."""
    full_attention, quantization = args.full_attention, args.quantization
    if args.cache is not None:
        replacement = "--quantization" if args.cache == "quantized" else f"--full-attention {args.cache}"
        print(f"jaxkv: warning: --cache {args.cache} is deprecated; use {replacement}", file=sys.stderr)
        full_attention = full_attention or ("static" if args.cache == "quantized" else args.cache)
        quantization = quantization or (True if args.cache == "quantized" else None)
        if args.cache != "quantized":  # the old flag chose plain storage over a config's quantization
            cache = {**cache, "quantization": None}
    cache = dict(cache)
    for key, flag in (("full_attention", full_attention), ("max_length", args.max_length), ("offload", args.offload)):
        if flag is not None:
            cache[key] = flag
    if quantization and cache["quantization"] is None:
        cache["quantization"] = {}
    flags = {key: getattr(args, f"kv_{key}") for _, key, _, _ in QUANT_FLAGS}
    options = {key: value for key, value in flags.items() if value is not None}
    if options and cache["quantization"] is None:
        raise ValueError(
            "the --kv-* options tune a quantized cache: add --quantization (or a cache.quantization config)"
        )
    if options:
        cache["quantization"] = {**cache["quantization"], **options}
    return cache


def run_generate(args) -> int:
    """Generate for each prompt; with ``--coordinator`` ... as one process of a group, which
    joins it before JAX touches a device, and prints only if it is process 0."""
    from jaxkv.decoding.generate import generate
    from jaxkv.decoding.sampling import Sampling

    config = resolve_config(args)
    distributed = Distributed.from_args(args)
    check_run(config, distributed, stream=args.stream)
    if distributed is not None:
        distributed.initialize()
    mesh = None if config.mesh is None else config.mesh.build()
    model, tokenizer, prompts, load_seconds = load_for_generate(config, args.weight_cache, mesh)
    printing = distributed is None or distributed.process_id == 0
    if config.num_beams > 1:
        return run_beams(config, model, tokenizer, prompts, printing)
    decoder = generate
    if config.speculative is not None:
        decoder = speculative_decoder(config, use_weight_cache=args.weight_cache, mesh=mesh)
    result = decoder(
        model,
        prompts,
        max_new_tokens=config.max_new_tokens,
        stop_tokens=tokenizer.eos_token_ids,
        sampling=Sampling(config.temperature, config.top_k, config.top_p, config.min_p),
        seed=config.seed,
        stream=token_printer(tokenizer) if args.stream else None,
        **cache_options(config),
    )
    if not printing:
        return 0
    if args.stream:
        print()  # ends the streamed text
    else:
        for row in range(len(prompts)):
            print_text(tokenizer, result.row(row), heading(row, len(prompts)))
    report_generation(config, prompts, result, load_seconds)
    return 0


def check_run(config: GenerateConfig, distributed: Distributed | None, *, stream: bool) -> None:
    """Refuse what a run cannot do, before anything loads: a group of processes without one mesh
    over them, a batch the mesh's data axis cannot split, or streaming more than one prompt's
    text (or from more than one process)."""
    if distributed is not None and config.mesh is None:
        raise ValueError(
            "a multi-process run shards one model over every process's devices: give --mesh (e.g. data=2,model=4 "
            "for 8 devices in all)"
        )
    if config.mesh is not None and len(config.prompts) % config.mesh.data:
        raise ValueError(
            f"mesh axis data of size {config.mesh.data} splits the batch rows, one per prompt, but there are "
            f"{len(config.prompts)}: give a multiple of {config.mesh.data} prompts, or shrink the data axis"
        )
    if stream and len(config.prompts) > 1:
        raise ValueError("--stream prints one prompt's text as it grows: give one --prompt, or drop --stream")
    if stream and distributed is not None and distributed.num_processes > 1:
        raise ValueError(
            "--stream prints from inside every process's decode loop: drop it for a multi-process run "
            "(process 0 prints the text at the end)"
        )


def heading(row: int, num_rows: int, hypothesis: str | None = None) -> str | None:
    """The line above one text: which prompt (when there are several) and which hypothesis."""
    parts = ([f"prompt {row}"] if num_rows > 1 else []) + ([hypothesis] if hypothesis else [])
    return f"--- {', '.join(parts)}" if parts else None


def print_text(tokenizer, tokens: list[int], title: str | None) -> None:
    if title is not None:
        print(title)
    print(tokenizer.decode(tokens))


def load_for_generate(config: GenerateConfig, use_weight_cache: bool, mesh: Mesh | None = None):
    """The model (sharded over ``mesh`` if given), its tokenizer, each prompt's token ids and
    the seconds loading took.

    The tokenizer loads first: whether the prompt takes the chat template is settled (and
    said) before the slow weight load."""
    import jax.numpy as jnp

    from jaxkv.models.load import Pretrained

    start = time.perf_counter()
    source = Pretrained(config.model, use_weight_cache=use_weight_cache)
    tokenizer = source.tokenizer(required=True)
    chat = config.chat and tokenizer.chat_template is not None
    if config.chat and not chat:
        print(f"jaxkv: {config.model} has no chat template: the prompt is plain text (--no-chat)", file=sys.stderr)
    model = source.model(jnp.dtype(config.dtype), mesh=mesh)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in config.prompts]
    return model, tokenizer, [tokenizer.encode(text) for text in texts], time.perf_counter() - start


def cache_options(config: GenerateConfig) -> dict:
    """The decoders' cache keywords from the config's ``cache`` section and its ``attention_backend``."""
    cache = config.cache
    return {
        "full_attention": cache.full_attention,
        "max_length": cache.max_length,
        "rollback_slots": cache.rollback_slots,
        "quantization": cache.quantization_spec(),
        "retrieval": cache.retrieval_spec(),
        "offload": cache.offload,
        "attention_backend": config.attention_backend,
    }


def token_printer(tokenizer):
    """A ``stream`` callback that prints row 0's text as it grows, stop tokens left out."""
    import numpy as np

    streamed: list[int] = []
    printed = [0]

    def stream(tokens: np.ndarray) -> None:
        """Row 0's tokens of one step (a scalar), or of one speculative round (a vector)."""
        streamed.extend(int(t) for t in np.ravel(tokens[0]) if t >= 0 and t not in tokenizer.eos_token_ids)
        text_so_far = tokenizer.decode(streamed)
        sys.stdout.write(text_so_far[printed[0] :])
        sys.stdout.flush()
        printed[0] = len(text_so_far)

    return stream


def report_generation(config: GenerateConfig, prompts: list[list[int]], result, load_seconds: float) -> None:
    """Counts, finish reasons, rates, compile and load time and cache size, on stderr."""
    fed, new = sum(map(len, prompts)), int(result.num_generated.sum())
    rows = f"{len(prompts)} prompts, " if len(prompts) > 1 else ""
    finish = ", ".join(reason.name.lower() for reason in result.finish)
    print(
        f"\n[{config.model}] {rows}prompt {fed} tok, {new} new ({finish}); "
        f"prefill {fed / result.prefill_seconds:.1f} tok/s, "
        f"decode {max(new - len(prompts), 1) / result.decode_seconds:.1f} tok/s; "
        f"compile {result.compile_seconds:.1f} s, load {load_seconds:.1f} s; "
        f"cache {result.cache_bytes / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    if config.speculative:
        print(
            f"[{config.speculative}, k={config.num_draft_tokens}] acceptance {result.acceptance_rate:.2f}, "
            f"{result.tokens_per_step:.2f} tokens per target pass",
            file=sys.stderr,
        )


def run_beams(config: GenerateConfig, model, tokenizer, prompts: list[list[int]], printing: bool) -> int:
    """Beam search for ``jaxkv generate --num-beams N``: each returned hypothesis and its score."""
    from jaxkv.decoding.beam import beam_search

    result = beam_search(
        model,
        prompts,
        max_new_tokens=config.max_new_tokens,
        num_beams=config.num_beams,
        length_penalty=config.length_penalty,
        early_stopping=config.early_stopping,
        num_return_sequences=config.num_return_sequences,
        stop_tokens=tokenizer.eos_token_ids,
        **cache_options(config),
    )
    if not printing:
        return 0
    several = config.num_return_sequences > 1
    for row in range(len(prompts)):
        for rank in range(config.num_return_sequences):
            hypothesis = f"hypothesis {rank} (score {result.scores[row, rank]:.4f})" if several else None
            print_text(tokenizer, result.sequence(row, rank), heading(row, len(prompts), hypothesis))
    print(
        f"\n[{config.model}] prompt {sum(map(len, prompts))} tok, {config.num_beams} beams; "
        f"prefill {result.prefill_seconds:.2f} s, search {result.search_seconds:.2f} s, "
        f"compile {result.compile_seconds:.1f} s; cache {result.cache_bytes / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    return 0


def speculative_decoder(config: GenerateConfig, *, use_weight_cache: bool, mesh: Mesh | None = None):
    """``generate_speculative`` with the configured drafter (a draft model on ``mesh`` too),
    called like ``generate``."""
    import functools

    import jax.numpy as jnp

    from jaxkv.decoding.speculative import DraftModel, PromptLookup, SelfSpeculation, generate_speculative
    from jaxkv.models.load import Pretrained

    if config.speculative == "prompt_lookup":
        drafter = PromptLookup()
    elif config.speculative == "self":
        drafter = SelfSpeculation(config.exit_layer)
    else:
        draft = Pretrained(config.draft_model, use_weight_cache=use_weight_cache)
        drafter = DraftModel(draft.model(jnp.dtype(config.dtype), mesh=mesh))
    return functools.partial(generate_speculative, drafter=drafter, num_draft_tokens=config.num_draft_tokens)


def _chat_parser(sub) -> None:
    parser = sub.add_parser("chat", help="multi-turn chat on stdin; each turn continues the previous turn's cache")
    parser.add_argument("--model", default="smollm2", help="as for generate")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens the whole conversation may hold")
    parser.add_argument(
        "--full-attention", choices=["static", "dynamic"], default="static", help="storage of full-attention layers"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-cache", dest="weight_cache", action="store_false", help=NO_CACHE_HELP)
    parser.add_argument("--load-cache", type=Path, help="resume from a cache file (jaxkv.persist) made for this model")
    parser.add_argument("--save-cache", type=Path, help="write the conversation's cache here at the end")


def run_chat(args) -> int:
    """One user message per stdin line; a reply feeds only the tokens the cache lacks."""
    import jax.numpy as jnp

    from jaxkv.decoding.session import Session
    from jaxkv.models.load import Pretrained
    from jaxkv.persist import load_cache, save_cache

    source = Pretrained(args.model, use_weight_cache=args.weight_cache)
    tokenizer = source.tokenizer(required=True)
    if tokenizer.chat_template is None:  # known before the slow weights load
        raise ValueError(f"{args.model} has no chat template, which chat needs; try jaxkv generate --no-chat")
    model = source.model(jnp.dtype(args.dtype))
    if args.load_cache:
        cache, tokens = load_cache(args.load_cache, model)
        if tokens is None:
            raise ValueError(f"{args.load_cache} stores no token ids; save it with save_cache(..., tokens=...)")
        session = Session(model, cache=cache, tokens=tokens[0])
    else:
        session = Session(model, max_length=args.max_length, full_attention=args.full_attention)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for turn, line in enumerate(sys.stdin):
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        conversation = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        result = session.reply(conversation, max_new_tokens=args.max_new_tokens, stop_tokens=tokenizer.eos_token_ids)
        answer = tokenizer.decode([t for t in result.row(0) if t not in tokenizer.eos_token_ids])
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
        print(
            f"[turn {turn}] prefilled {session.fed_tokens} of {len(conversation)} conversation tokens (the rest "
            f"from the cache) in {result.prefill_seconds:.2f} s; {int(result.num_generated[0])} new "
            f"({result.finish[0].name.lower()}) in {result.decode_seconds:.2f} s",
            file=sys.stderr,
        )
    if args.save_cache:
        save_cache(args.save_cache, session.cache, model, tokens=[session.tokens])
        print(f"[chat] cache of {len(session.tokens)} tokens saved to {args.save_cache}", file=sys.stderr)
    return 0


BENCHMARKS = {"decode": "jaxkv.bench.decode", "serving": "jaxkv.bench.serving", "attention": "jaxkv.bench.attention",
              "latent": "jaxkv.bench.latent"}


def _bench_parser(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks against transformers: decode speed, or serving (the engine)")
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options (--help lists them)")


def run_bench(args) -> int:
    """``jaxkv bench NAME OPTIONS``: the benchmark module's own command line."""
    return importlib.import_module(BENCHMARKS[args.benchmark]).main(args.options)


class ServeSpeculativeConfig(Strict):
    """``jaxkv serve``'s speculation (the engine's ``SpeculativeConfig``, whose checks it runs):
    ``draft_model`` is a model name, checkpoint directory or .gguf, loaded as ``model`` is."""

    method: str = "ngram"  # 'ngram' (prompt lookup) or 'draft' (draft_model drafts)
    num_tokens: int = 4  # drafts verified per step
    max_ngram: int = 4
    min_ngram: int = 2
    always_verify: bool = False  # verify every draft (no measured rule): reproducible seeded sampling
    draft_model: str | None = None

    @model_validator(mode="after")
    def _engine_accepts(self):
        from jaxkv.serving.speculation import SpeculativeConfig

        SpeculativeConfig(**self.model_dump())  # the name stands in for the model: the same checks
        return self

    def engine_config(self, draft_model=None):
        """The engine's ``SpeculativeConfig``, with ``draft_model`` (the loaded model) for 'draft'."""
        from jaxkv.serving.speculation import SpeculativeConfig

        return SpeculativeConfig(**self.model_dump(exclude={"draft_model"}), draft_model=draft_model)


class ServeConfig(Strict):
    """What ``jaxkv serve`` runs; ``--config FILE`` (YAML, e.g. configs/serve.yaml) sets any of these."""

    model: str = "smollm2"
    served_model_name: str | None = None  # the name clients pass as `model` (default: model)
    host: str = "127.0.0.1"
    port: int = 8000
    kv_memory: str = "1GiB"
    host_kv_memory: str = "0"  # host memory under the page pools (demoted prefix pages, swapped sequences)
    kv_cache_dir: str | None = None  # the prefix cache's disk tier: a restarted server starts warm
    disk_kv_memory: str = "16GiB"  # the disk tier's size limit per pool
    page_size: PositiveInt = 16
    max_num_seqs: PositiveInt = 16
    max_num_batched_tokens: PositiveInt = 256
    max_model_len: PositiveInt | None = None
    max_waiting: PositiveInt = 64
    prefix_caching: bool = True
    quantization: QuantizationConfig | None = None  # quantized pages (per token, residual_length 0)
    eviction: BudgetedEvictionConfig | None = None  # full-attention K/V in a budget of slots per request
    mesh: MeshConfig | None = None  # shard the model and the page pools over the devices (this process's)
    speculative: ServeSpeculativeConfig | None = None  # draft tokens verified in the engine's steps
    max_pages_per_request: PositiveInt | None = None  # compressed pages: full-attention pages per request
    compaction_policy: str = "streaming_llm"  # what a compaction keeps (jaxkv.serving.compaction.COMPACTION_POLICIES)
    compaction_choice: Literal["pool", "head"] = "pool"  # one choice for the pool, or each layer and K/V head's own
    attention_backend: Literal[BACKENDS] = "xla"  # reads decodes (docs/kernels.md)
    pool_layout: Literal["tokens", "heads"] = "tokens"  # pages [P, page, H_kv, D] or [P, H_kv, page, D]
    # Quest over the full-attention pool: each decode token reads `budget` tokens of pages chosen by
    # their key summaries (its page_size is the server's; prefill: dense, the default here, or retrieve).
    retrieval: RetrievalConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _retrieval_over_the_pool(cls, data):
        """A ``retrieval`` section's pages are the pool's: its page_size and prefill default to the
        server's ``page_size`` and 'dense' (prefill chunks read every page, decode tokens retrieve)."""
        if isinstance(data, dict) and isinstance(data.get("retrieval"), dict):
            defaults = {"page_size": data.get("page_size", cls.model_fields["page_size"].default), "prefill": "dense"}
            data = data | {"retrieval": defaults | data["retrieval"]}
        return data

    @model_validator(mode="after")
    def _retrieval_pages_are_the_pools(self):
        if self.retrieval is not None and self.retrieval.page_size != self.page_size:
            raise ValueError(
                f"retrieval.page_size ({self.retrieval.page_size}) must be page_size ({self.page_size}): it chooses "
                "the pool's pages"
            )
        return self

    @model_validator(mode="after")
    def _engine_accepts(self):
        """The engine's own checks now, not after the model has loaded (the draft model's name
        stands in for the model)."""
        self.engine_config(None if self.speculative is None else self.speculative.draft_model)
        return self

    def engine_config(self, draft_model=None) -> EngineConfig:
        """The engine's config as this sets it (``draft_model``: the loaded ``speculative.draft_model``)."""
        from jaxkv.serving import EngineConfig

        engine_fields = {field.name for field in dataclasses.fields(EngineConfig)} - set(_ENGINE_SECTIONS)
        sections = {name: None if getattr(self, name) is None else spec(getattr(self, name), draft_model)
                    for name, spec in _ENGINE_SECTIONS.items()}  # fmt: skip
        return EngineConfig(**self.model_dump(include=engine_fields), **sections)

    @model_validator(mode="after")
    def _eviction_without_prefix_caching(self):
        if self.eviction is not None and self.prefix_caching:
            raise ValueError(
                "eviction keeps each request's K/V in its own slots, which prefix caching cannot share: set "
                "prefix_caching: false (or --no-prefix-caching)"
            )
        return self


# ServeConfig's sections that become engine specs: each section's spec (given the loaded draft model).
_ENGINE_SECTIONS = {
    "quantization": lambda section, _: section.spec(),
    "eviction": lambda section, _: section.budgeted_spec(),
    "speculative": lambda section, draft_model: section.engine_config(draft_model),
    "retrieval": lambda section, _: section.spec(),
}

SERVE_FLAGS = tuple(
    name for name in ServeConfig.model_fields
    if name not in ("quantization", "eviction", "mesh", "speculative", "retrieval")
)
# Flag, ServeSpeculativeConfig field, type, help.
SPECULATIVE_FLAGS = (
    ("--speculative-method", "method", str, "ngram (prompt lookup over the request's tokens) or draft (--draft-model)"),
    ("--speculative-tokens", "num_tokens", int, "draft tokens verified per step, 1 to 15 (default 4)"),
    ("--speculative-max-ngram", "max_ngram", int, "ngram: the longest n-gram matched (default 4)"),
    ("--speculative-min-ngram", "min_ngram", int, "ngram: the shortest n-gram matched (default 2)"),
    ("--speculative-always-verify", "always_verify", bool,
     "verify every draft, not only when measured step times say it pays (reproducible seeded sampling)"),
    ("--draft-model", "draft_model", str, "draft: a smaller model with the same vocabulary (name, directory, .gguf)"),
)  # fmt: skip


def _serve_parser(sub) -> None:
    parser = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the serving engine")
    parser.add_argument("--config", type=Path, help="YAML file (configs/serve.yaml); flags below override it")
    parser.add_argument("--model", help="embedded default name, a checkpoint directory or a .gguf (default smollm2)")
    parser.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="default 8000")
    parser.add_argument("--kv-memory", help="bytes for the K/V page pools, e.g. 512MiB (default 1GiB)")
    parser.add_argument(
        "--host-kv-memory", help="host memory under the page pools for evicted prefix pages and swapped requests, "
        "e.g. 512MiB (default 0: none)"
    )
    parser.add_argument(
        "--kv-cache-dir", help="a directory for the prefix cache's disk tier: every cached page is saved there and a "
        "restarted server finds it (default: none)"
    )
    parser.add_argument("--disk-kv-memory", help="the disk tier's size limit per pool, e.g. 8GiB (default 16GiB)")
    parser.add_argument("--page-size", type=int, help="tokens per page (default 16)")
    parser.add_argument("--max-num-seqs", type=int, help="requests decoding at once (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="prefill tokens per step (default 256)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    parser.add_argument("--max-waiting", type=int, help="queued requests before answering 503 (default 64)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None)
    parser.add_argument(
        "--max-pages-per-request", type=int, help="compressed pages: at most this many full-attention pages per "
        "request, its tokens compacted into one page fewer when it needs more (default: unbounded)"
    )
    parser.add_argument(
        "--compaction-policy", help="what a compaction keeps: streaming_llm (sinks and recent tokens, the default), "
        "key_norm (low-norm keys), h2o, zipage (attention received), snapkv or pyramidkv (a long prompt prefilled "
        "whole, then compacted by the attention of its last queries; pyramidkv: fewer tokens in later layers)"
    )
    parser.add_argument(
        "--compaction-choice", choices=("pool", "head"), help="who shares a compaction's choice of tokens: every "
        "layer and K/V head of the pool, by their mean score (pool, the default), or none (head: each its own)"
    )
    parser.add_argument(
        "--attention-backend", choices=BACKENDS, help="what reads the paged "
        "decode tokens: xla (default), a Pallas kernel, or auto (the platform's kernel, else xla); docs/kernels.md"
    )
    parser.add_argument(
        "--pool-layout", choices=("tokens", "heads"), help="how pages are stored: tokens [P, page, H_kv, D] "
        "(default) or heads [P, H_kv, page, D], which the Pallas kernels read in place page by page"
    )
    parser.add_argument(
        "--retrieval-budget", type=int, help="page retrieval (Quest): each decode token reads this many tokens of "
        "pages per K/V head, chosen by their keys' min/max (a multiple of --page-size; the config's retrieval: "
        "section sets the rest)"
    )
    parser.add_argument("--mesh", help=MESH_HELP + " (this process's devices)")
    spec = parser.add_argument_group("speculative decoding (greedy output unchanged; off unless a method is set)")
    for flag, key, kind, help_text in SPECULATIVE_FLAGS:
        if kind is bool:  # a switch: present means True
            spec.add_argument(flag, dest=f"speculative_{key}", action="store_const", const=True, help=help_text)
        else:
            spec.add_argument(flag, dest=f"speculative_{key}", type=kind, help=help_text)


def resolve_serve_config(args) -> ServeConfig:
    """The YAML config (if any) with the command-line flags on top, validated as a whole."""
    merged = (load_config(args.config, ServeConfig) if args.config else ServeConfig()).model_dump()
    merged |= {key: getattr(args, key) for key in SERVE_FLAGS if getattr(args, key) is not None}
    merged["speculative"] = speculative_settings(args, merged["speculative"])
    if args.retrieval_budget is not None:
        merged["retrieval"] = (merged["retrieval"] or {}) | {"budget": args.retrieval_budget}
    if merged["retrieval"] is not None:  # its pages are the pool's: page_size is the server's, flag included
        merged["retrieval"] = {key: value for key, value in merged["retrieval"].items() if key != "page_size"}
    return ServeConfig.model_validate(merged | mesh_setting(args))


def speculative_settings(args, speculative: dict | None) -> dict | None:
    """The config's ``speculative`` section with the ``--speculative-*`` and ``--draft-model``
    flags on top; the flags tune speculation, so without the section they need ``--speculative-method``."""
    flags = {key: getattr(args, f"speculative_{key}") for _, key, _, _ in SPECULATIVE_FLAGS}
    options = {key: value for key, value in flags.items() if value is not None}
    if options and speculative is None and "method" not in options:
        given = ", ".join(flag for flag, key, _, _ in SPECULATIVE_FLAGS if key in options)
        raise ValueError(f"{given} tune speculative decoding: add --speculative-method (or a speculative: config)")
    return speculative if not options else {**(speculative or {}), **options}


def serving_engine(config: ServeConfig, model, tokenizer=None, draft_model=None) -> Engine:
    """The engine ``jaxkv serve`` runs ``model`` on, as ``config`` sets it (``draft_model``: the
    loaded ``speculative.draft_model``)."""
    from jaxkv.serving import Engine

    return Engine(model, config.engine_config(draft_model), tokenizer=tokenizer)


def run_serve(args) -> int:
    """Load, build the engine, compile every step shape, then serve until SIGINT/SIGTERM."""
    from jaxkv.server.api import Server, serve
    from jaxkv.models.load import load_pretrained
    from jaxkv.serving.engine_thread import EngineThread

    config = resolve_serve_config(args)
    mesh = None if config.mesh is None else config.mesh.build()
    model, tokenizer = load_pretrained(config.model, mesh=mesh)  # the engine shards its pools like the model
    if tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer: the server needs one for text prompts and outputs")
    draft_model = None
    if config.speculative is not None and config.speculative.draft_model is not None:
        draft_model = load_pretrained(config.speculative.draft_model, mesh=mesh)[0]  # its tokenizer is the model's
    engine = serving_engine(config, model, tokenizer, draft_model)
    start = time.perf_counter()
    engine.warmup()
    name = config.served_model_name or config.model
    print(f"jaxkv serve: {name} ready at http://{config.host}:{config.port}/v1 (compiled in "
          f"{time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    serve(Server(EngineThread(engine, config.max_waiting).start(), tokenizer, name), config.host, config.port)
    return 0


def _train_mqar_parser(sub) -> None:
    parser = sub.add_parser("train-mqar", help="train the multi-query associative recall model (jaxkv.research.mqar)")
    parser.add_argument("config", type=Path, help="YAML file (configs/mqar.yaml)")
    parser.add_argument("--output", type=Path, help="checkpoint directory (default: the config's output)")


def run_train_mqar(args) -> int:
    """Train, then save the checkpoint, loss curve and metrics; print where and the recall reached."""
    from jaxkv.research.mqar import MQARConfig, train  # jax, flax and optax load only for this command

    result = train(load_config(args.config, MQARConfig), args.output)
    print(f"[train-mqar] {len(result.losses)} steps in {result.seconds:.1f} s, final loss {result.losses[-1]:.4f}, "
          f"recall {result.recall:.4f} (full cache); saved to {result.output}", file=sys.stderr)  # fmt: skip
    return 0


def _experiment_parser(sub) -> None:
    parser = sub.add_parser("experiment", help="run a grid of model x task x K/V cache x budget x seed")
    parser.add_argument(
        "config", type=Path, nargs="+",
        help="YAML grid(s), e.g. configs/experiments/smoke.yaml; several run as one, cells ordered by cache shape",
    )  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="list the cells (done or to run) and exit")
    parser.add_argument("--output-dir", type=Path, default=Path("results"), help="results go to OUTPUT_DIR/NAME/")
    parser.add_argument(
        "--compile-cache", type=Path, default=None,
        help="keep compiled programs in this directory (JAX's persistent compilation cache): a rerun, or a run of "
        "other grids with equal shapes, skips their compile",
    )  # fmt: skip


def run_experiment(args) -> int:
    """``jaxkv experiment CONFIG...``: each grid's unfinished cells, then its summary and plot
    (``jaxkv.research.experiment``, imported only for this command)."""
    from jaxkv.research.experiment import run_command

    if args.compile_cache is not None and not args.dry_run:
        # Most of a cell after a context's prefill is compiling its cache's refill and decode; the
        # grids of one command repeat those shapes (passkey and retrieval at 2k, ...).
        import jax

        jax.config.update("jax_compilation_cache_dir", str(args.compile_cache))
    return run_command(args.config, args.output_dir, dry_run=args.dry_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Functional KV caches for JAX models")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _chat_parser(sub)
    _bench_parser(sub)
    _serve_parser(sub)
    _train_mqar_parser(sub)
    _experiment_parser(sub)
    launch.add_parser(sub)
    return parser


COMMANDS = {
    "generate": run_generate, "chat": run_chat, "serve": run_serve, "bench": run_bench, "launch": launch.run_launch,
    "experiment": run_experiment,
    "train-mqar": run_train_mqar,
}  # fmt: skip


# The modules a command needs beyond the core install, by the extra of pyproject.toml that installs them
# (tests/app/test_architecture.py checks these against pyproject).
EXTRAS = {"serve": ("fastapi", "uvicorn", "prometheus_client"), "research": ("optax", "matplotlib", "gensim")}
COMMAND_EXTRAS = {"serve": "serve", "experiment": "research", "train-mqar": "research"}


class MissingExtra(ImportError):
    """A command's optional dependencies are not installed; the message names the extra to install."""


def _check_extra(command: str) -> None:
    """Raise ``MissingExtra`` before ``command`` runs (not deep into it) when a module of its extra is missing."""
    extra = COMMAND_EXTRAS.get(command)
    missing = [name for name in EXTRAS.get(extra, ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(
            f"jaxkv {command} needs the {extra} extra ({', '.join(missing)} not installed): "
            f"pip install 'jaxkv[{extra}]'"
        )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_extra(args.command)
        with one_line_warnings():
            return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, MissingExtra) as error:
        print(f"jaxkv: error: {error}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def one_line_warnings():
    """Warnings as ``jaxkv: warning: ...`` lines, without the file, line and source of the code
    that raised them (a mesh axis that cannot split the K/V heads: what to do is in the text)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"jaxkv: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
