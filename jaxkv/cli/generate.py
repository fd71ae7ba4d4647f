"""``jaxkv generate``: text from a real model through a jaxkv cache, with timings.

    jaxkv generate --model smollm2 --prompt "What is a KV cache?" --max-new-tokens 64
    jaxkv generate --config configs/smollm2.yaml --stream
    jaxkv generate --num-beams 4 --num-return-sequences 2 --early-stopping true
    jaxkv generate --full-attention dynamic --quantization --kv-bits 8
    jaxkv generate --offload        (full-attention K/V in host memory; --offload all, --offload 0,1,2)
    jaxkv generate --mesh data=2,model=4 --prompt "One" --prompt "Two"   (sharded over 8 devices)
    jaxkv launch --num-processes 2 --devices-per-process 4 -- generate --mesh data=2,model=4 ...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, get_args

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from jaxkv.cli import launch
from jaxkv.cli.launch import Distributed
from jaxkv.config import MESH_HELP, WEIGHTS_HELP, CacheConfig, MeshConfig, Strict, Weights, load_config
from jaxkv.kernels import BACKENDS

if TYPE_CHECKING:
    from jax.sharding import Mesh


class GenerateConfig(Strict):
    """What ``jaxkv generate`` runs; a YAML file under configs/ sets any of these."""

    model: str = "smollm2"
    prompt: str | Annotated[list[str], Field(min_length=1)] = "What is a KV cache, in two sentences?"  # list: a batch
    chat: bool = True
    max_new_tokens: PositiveInt = 64
    dtype: Literal["float32", "bfloat16"] = "float32"
    weights: Weights | None = None  # how the model's matrices are held: jaxkv.models.load.WEIGHTS (None: its default)
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


def add_parser(sub) -> None:
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
    parser.add_argument("--weights", choices=get_args(Weights), help=WEIGHTS_HELP)
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
        "model", "prompt", "chat", "max_new_tokens", "dtype", "weights", "temperature", "top_k", "top_p", "min_p",
        "seed", "speculative", "num_draft_tokens", "draft_model", "exit_layer", "num_beams", "length_penalty",
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


def run(args) -> int:
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
    model = source.model(jnp.dtype(config.dtype), weights=config.weights, mesh=mesh)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in config.prompts]
    return model, tokenizer, [tokenizer.encode(text) for text in texts], time.perf_counter() - start


def cache_options(config: GenerateConfig) -> dict:
    """The decoders' cache keywords from the config's ``cache`` section and its ``attention_backend``."""
    cache = config.cache
    return {
        "full_attention": cache.full_attention,
        "max_length": cache.max_length,
        "rollback_slots": cache.rollback_slots,
        "quantization": cache.quantization,
        "retrieval": cache.retrieval,
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
