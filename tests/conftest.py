import copy
import functools
import os
from pathlib import Path

import jax
import pytest
from hypothesis import settings

# Eight host devices, as the sharding tests' meshes (1x8, 2x4, 4x2, 8x1) need; everything else runs
# on the first as before. Set before any test touches a backend.
jax.config.update("jax_num_cpu_devices", 8)

# CI replays the same examples every run; locally hypothesis explores.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=12, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=12)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def parse_each_gguf_once() -> None:
    """transformers, the parity oracle, parses a GGUF's whole metadata (Gemma 3's 262k-token
    vocabulary included: 15-20 s here) for a model's config, again for its weights and again for
    its tokenizer's config. Each test process keeps one ``gguf.GGUFReader`` and one parsed
    metadata per file instead (both read-only), keyed by path, size and modification time so a
    rewritten file is read again."""
    try:
        import gguf
        import transformers.modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:  # without the parity extra there is no oracle to speed up
        return

    def file_key(path) -> tuple:
        stat = Path(path).stat()
        return str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns

    uncached_reader, uncached_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers = functools.lru_cache(maxsize=8)(lambda key, mode: uncached_reader(key[0], mode))
    metadata = functools.lru_cache(maxsize=8)(lambda key: uncached_load(key[0], return_tensors=False))
    gguf.GGUFReader = lambda path, mode="r": readers(file_key(path), mode)

    def load_gguf_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return uncached_load(path, return_tensors=return_tensors, **kwargs)
        return copy.deepcopy(metadata(file_key(path)))  # callers edit what they get

    hf_gguf.load_gguf_checkpoint = load_gguf_checkpoint


parse_each_gguf_once()


# Most tests run tiny models for a few steps: XLA's compile is most of their time (about 85% in
# the engine's tests) and its LLVM optimizations never pay for themselves there. They compile with
# `jax_disable_most_optimizations` (LLVM at -O0: about 40% less compile time; results may differ
# from optimized code in the last bit, so a comparison never mixes the two). The files in
# OPTIMIZED_FILES run real weights for many tokens and compile as users do. The environment
# variable carries the file's setting to the processes its tests start (docs/testing.md).
OPTIMIZED_FILES = {
    "test_smollm2.py", "test_engine_models.py", "test_mqar.py", "test_server.py", "test_load_test.py",
    "test_hostile_inputs.py", "test_failures.py", "test_guidellm.py", "test_speculative_gemma3.py",
    "test_sharding_smollm2.py", "test_gemma3_gguf.py", "test_beam_smollm2.py",
    "test_experiment_smoke.py", "test_server_speculation.py", "test_server_speculation_draft.py",
    "test_eviction_smollm2.py", "test_kept_weights.py",
}  # fmt: skip


# XLA's CPU fusion emitters (its MLIR code generators for fused ops, on by default) make up a third
# to a half of some files' -O0 compile, which its older LLVM emitters do not take: test_linear.py
# 60.2 -> 33.6 CPU s, test_container.py 38.0 -> 28.8 (docs/testing.md). The -O0 compiles use the
# older emitters; optimized files keep XLA's defaults.
FAST_COMPILE_OPTIONS = (("xla_cpu_use_fusion_emitters", False),)
FAST_COMPILE_XLA_FLAGS = " ".join(f"--{name}={str(value).lower()}" for name, value in FAST_COMPILE_OPTIONS)


def _compile_fast_at_o0() -> None:
    """Each compile JAX makes under ``jax_disable_most_optimizations`` gets ``FAST_COMPILE_OPTIONS``
    (XLA reads them as per-compile overrides of its flags, as ``jax.jit(compiler_options=...)``
    passes them)."""
    from jax._src import compiler

    default_options = compiler.get_compile_options

    def get_compile_options(*args, **kwargs):
        options = default_options(*args, **kwargs)
        if compiler._DISABLE_MOST_OPTIMIZATIONS.value:
            options.env_option_overrides = [*options.env_option_overrides, *FAST_COMPILE_OPTIONS]
        return options

    compiler.get_compile_options = get_compile_options


_compile_fast_at_o0()
jax.devices()  # the backend reads XLA_FLAGS once, here: what _optimize sets below reaches child processes only
XLA_FLAGS = os.environ.get("XLA_FLAGS", "")


def _optimize(optimized: bool) -> None:
    jax.config.update("jax_disable_most_optimizations", not optimized)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if optimized else "1"
    os.environ["XLA_FLAGS"] = XLA_FLAGS if optimized else f"{XLA_FLAGS} {FAST_COMPILE_XLA_FLAGS}".strip()


_optimize(False)


@pytest.fixture(autouse=True, scope="module")
def full_optimization_for_real_weights(request):
    """The module's XLA optimization setting (autouse: before its other fixtures compile anything)."""
    _optimize(request.path.name in OPTIMIZED_FILES)
    yield
    _optimize(False)


@pytest.fixture(autouse=True, scope="module")
def drop_compiled_executables():
    """After each test file, drop JAX's compiled executables: a worker process would
    otherwise keep those of every file it ran (GBs over the suite), and XLA's CPU compiler
    has aborted deep into such runs."""
    yield
    jax.clear_caches()


# Seconds each of the slowest test files took on this 2-core machine (one full run, 2026-12-05,
# other work beside it; the server files as optimized before; the files split off for their real
# weights and what they left behind: their tests' seconds in that run, scaled by the CPU time the
# optimized compile saved them). `--dist loadfile` hands whole files
# to the two workers in collection order, so running alphabetically left one worker alone with the
# last big files for minutes; longest first (the files not listed follow in their usual order)
# keeps both busy to the end.
FILE_SECONDS = {
    "test_speculative.py": 169, "test_sharding.py": 135, "test_gemma3.py": 50, "test_engine.py": 120,
    "test_eviction_smollm2.py": 50,
    "test_eviction.py": 140, "test_engine_models.py": 152, "test_properties.py": 98, "test_quantized.py": 90,
    "test_engine_sharding.py": 98, "test_beam.py": 25, "test_server.py": 100, "test_bench_serving.py": 112,
    "test_bench_smoke.py": 87, "test_smollm2.py": 94, "test_experiment.py": 24, "test_mqar.py": 82,
    "test_models_toy.py": 67, "test_hostile_inputs.py": 45, "test_guidellm.py": 54, "test_linear.py": 69,
    "test_eviction_parity.py": 66, "test_prefix_chat.py": 55, "test_llama_parity.py": 49, "test_observer.py": 49,
    "test_layer_protocol.py": 45, "test_container.py": 45, "test_speculative_gemma3.py": 40,
    "test_sharding_smollm2.py": 18, "test_gemma3_gguf.py": 73, "test_beam_smollm2.py": 62,
    "test_experiment_smoke.py": 62, "test_offload.py": 47, "test_engine_tiers.py": 20, "test_engine_disk.py": 15,
    "test_tier_ledger.py": 10, "test_disk_tier.py": 8, "test_speculation.py": 103, "test_retrieval.py": 70,
    "test_gemma4_parity.py": 70, "test_shared_kv.py": 30,
    "test_compaction.py": 75, "test_deepseek_v32_parity.py": 60, "test_latent.py": 32,
    "test_attention_backends.py": 90, "test_bench_attention.py": 8, "test_bench_latent.py": 14,
    "test_paged_latent.py": 22, "test_kept_weights.py": 120, "test_cpu_paged_attention.py": 40,
    "test_quantized_kernels.py": 21, "test_bench_llama_cpp.py": 15,
}  # fmt: skip


# Markers across components (docs/testing.md). Each test folder is a component and marks its tests
# with its name (`pytest -m serving`); these files also carry:
PARITY_FILES = {  # compare with transformers or kvpress, the [parity] extra's oracles
    "test_beam.py", "test_beam_smollm2.py", "test_eviction_parity.py", "test_encoder_decoder.py",
    "test_layer_protocol.py", "test_linear.py", "test_properties.py", "test_quantized.py", "test_gemma3.py",
    "test_gemma3_gguf.py", "test_llama_parity.py", "test_qwen3_5_parity.py", "test_smollm2.py", "test_tokenizer.py",
    "test_weights.py", "test_cli_mesh.py", "test_gemma4_parity.py", "test_shared_kv.py", "test_deepseek_v32_parity.py",
}  # fmt: skip
MULTIDEVICE_FILES = {  # run on meshes of the 8 host devices, or several processes
    "test_engine_sharding.py", "test_sharding.py", "test_sharding_smollm2.py", "test_sharding_table.py",
    "test_distributed.py", "test_cli_mesh.py",
}  # fmt: skip
SERVER_FILES = {  # start a server on 127.0.0.1
    "test_server.py", "test_load_test.py", "test_bench_serving.py", "test_hostile_inputs.py", "test_failures.py",
    "test_guidellm.py", "test_server_speculation.py", "test_server_speculation_draft.py",
}  # fmt: skip
# Tests (by file and function, every parametrization) over ~4 s each on this machine, their module
# fixtures' loads counted: `pytest -m "not slow"` leaves them out (the quick tier).
SLOW: dict[str, set[str]] = {
    "test_speculation.py": {
        "test_sampled_tokens_follow_the_target_distribution", "test_qwen3_5_recurrent_states_roll_back",
        "test_quantized_pages_roll_back", "test_ngram_speculation_equals_generate_with_staggered_arrivals",
        "test_accepted_and_rejected_drafts_equal_generate_under_preemption", "test_draft_model_speculation_equals_generate",
        "test_swap_preemption_with_drafts_equals_generate",
    },
    "test_beam.py": {
        "test_beam_search_equals_transformers", "test_cli_beam_flags",
    },
    "test_beam_smollm2.py": {"test_smollm2_beam_search_equals_transformers"},
    "test_gemma4_parity.py": {
        "test_config_reads_transformers_names", "test_prefill_and_decode_logits_match_transformers",
        "test_greedy_generate_matches_transformers", "test_engine_with_pages_equals_generate",
        "test_early_exit_matches_transformers_first_layers",
    },
    "test_shared_kv.py": {"test_reusing_layers_see_what_the_storing_layer_saw"},
    "test_deepseek_v32_parity.py": {
        "test_prefill_and_decode_logits_match_transformers", "test_yarn_logits_match_transformers",
        "test_greedy_generate_matches_transformers", "test_a_shared_prefix_continues_as_transformers",
        "test_engine_equals_generate", "test_speculative_greedy_equals_plain_greedy",
    },
    "test_latent.py": {
        "test_absorbed_and_plain_forms_equal_expanded_attention", "test_attention_over_the_selection_is_a_dense_mask_of_it",
        "test_indexer_keys_follow_rollback_reorder_select_and_repeat",
    },
    "test_behaviours.py": {"test_one_query_path_equals_the_batched_one"},
    "test_offload.py": {"test_bench_offload_smoke"},
    "test_bench_serving.py": {
        "test_engine_systems_on_a_tiny_llama", "test_static_and_transformers_on_a_tiny_llama",
        "test_multi_turn_with_the_host_tier_on_a_tiny_llama", "test_compressed_pages_on_a_tiny_llama",
    },
    "test_bench_smoke.py": {"test_bench_decode_quantized_and_gpu_refusal", "test_bench_decode_tiny_jaxkv"},
    "test_cli.py": {
        "test_generate_smollm2_prints_text_and_timings", "test_prompt_lengths_share_compiled_code_within_a_bucket",
        "test_prompt_too_long_is_refused_before_compiling",
    },
    "test_cli_mesh.py": {"test_mesh_gives_the_same_tokens_and_warns_once"},
    "test_cli_options.py": {"test_serve_config_eviction"},
    "test_compaction.py": {
        "test_compacted_rows_keep_what_an_evicting_layer_keeps", "test_compacted_slots_hold_the_kv_of_the_positions_they_say",
        "test_no_page_leaks_after_compactions_aborts_and_preemptions", "test_compaction_on_a_mesh_equals_one_device",
        "test_a_budget_covering_every_token_gives_generates_tokens", "test_nan_in_freed_pages_changes_nothing",
    },
    "test_container.py": {
        "test_per_row_rollback_then_refeed_restores_the_cache",
        "test_stacked_cache_in_a_scan_equals_unstacked_updates",
    },
    "test_distributed.py": {"test_two_processes_print_what_one_prints"},
    "test_encoder_decoder.py": {
        "test_beam_search_matches_transformers", "test_cross_attention_admits_exactly_the_encoder_tokens",
        "test_greedy_generate_matches_transformers", "test_prefill_and_decode_logits_match_transformers",
        "test_reorder_and_select_gather_rows_in_both_halves", "test_sampled_generate_draws_from_the_models_top_k",
    },
    "test_engine.py": {
        "test_evicted_rows_equal_generate_with_the_same_policy",
        "test_eviction_with_room_for_everything_serves_exactly", "test_hybrid_recurrent_states_live_in_row_slots",
        "test_no_compile_after_warmup", "test_poisoned_free_pages_do_not_leak",
        "test_preempted_requests_finish_with_the_same_tokens", "test_prefix_hit_equals_miss",
        "test_quantized_pages_match_a_static_quantized_cache", "test_row_sampling_follows_each_rows_parameters",
        "test_staggered_arrivals_equal_generate",
    },
    "test_engine_inputs.py": {
        "test_stop_token_ids_add_to_the_end_of_sequence_token", "test_the_largest_top_k_and_seed_run",
    },
    "test_engine_models.py": {
        "test_gemma3_past_its_window_and_a_mid_prompt_prefix_hit_equal_generate",
        "test_smollm2_32_requests_arriving_over_time_equal_generate", "test_stop_strings_with_the_real_tokenizer",
        "test_smollm2_speculation_equals_generate", "test_smollm2_retrieval_equals_generate",
    },
    "test_engine_sharding.py": {
        "test_greedy_tokens_equal_generate", "test_quantized_pages_on_a_mesh_equal_generate",
        "test_rows_need_not_divide_the_data_axis_without_per_row_slots", "test_speculation_on_a_mesh_equals_generate",
    },
    "test_eviction_smollm2.py": {
        "test_a_row_within_the_budget_equals_the_plain_cache", "test_plain_caches_read_in_other_shapes_differ_as_much",
    },
    "test_eviction.py": {
        "test_attention_slot_mass_sums_to_the_weighted_queries", "test_compression_ratio_zero_builds_the_full_cache",
        "test_evicting_an_observed_prefill_equals_prefilling_at_the_budget",
        "test_gemma3_evicts_its_full_layers_and_keeps_its_sliding_rings",
        "test_generate_and_beam_search_run_with_eviction", "test_h2o_scores_are_the_accumulated_attention_mass",
        "test_large_budget_matches_full_cache__with_jit", "test_large_budget_matches_full_cache__without_jit",
        "test_model_greedy_tokens_with_a_budget_holding_everything",
        "test_outputs_attend_over_kept_slots_and_new_tokens",
        "test_pyramidkv_holds_its_mean_budget_and_equals_one_cache_per_layer_budget",
        "test_rollback_and_speculative_decoding_refuse_eviction",
        "test_snapkv_scores_are_the_pooled_observation_window_mass",
        "test_streaming_llm_keeps_sinks_and_the_most_recent_tokens",
    },
    "test_eviction_parity.py": {
        "test_scored_policy_keeps_kvpress_positions", "test_streaming_llm_keeps_kvpress_positions",
    },
    "test_experiment.py": {
        "test_every_cache_of_a_context_shares_one_prefill", "test_mqar_cells_run_on_their_checkpoint",
        "test_perplexity_windows_are_seeded_and_batched",
    },
    "test_experiment_smoke.py": {"test_smoke_grid_end_to_end_and_resumes"},
    "test_gemma3.py": {
        "test_early_exit_matches_transformers_first_layers", "test_greedy_generate_matches_transformers",
        "test_prefill_and_decode_logits_match_transformers",
    },
    "test_gemma3_gguf.py": {
        "test_gguf_config_and_params_equal_transformers", "test_gguf_tokenizer_equals_transformers",
        "test_greedy_generation_equals_transformers",
    },
    "test_hugepages.py": {"test_small_arrays_are_left_alone_and_model_weights_are_moved"},
    "test_layer_protocol.py": {
        "test_a_quantized_ring_counts_its_budget_from_the_store", "test_nan_padding_never_reaches_a_product",
        "test_repeated_rollbacks_share_a_ring_budget",
    },
    "test_linear.py": {
        "test_container_builds_routes_and_gathers_rows", "test_every_state_kind__with_jit",
        "test_every_state_kind__without_jit", "test_rollback_beyond_budget",
        "test_rollback_then_refeed_equals_never_fed", "test_state_bytes_do_not_grow_with_length",
    },
    "test_llama_parity.py": {
        "test_early_exit_matches_transformers_first_layers", "test_greedy_generate_matches_transformers",
        "test_out_in_layout_reads_scanned_weights_in_place_at_batch_one",
        "test_prefill_and_decode_logits_match_transformers",
    },
    "test_load_test.py": {"test_quick_run_completes_every_request_over_http_and_in_process"},
    "test_models_toy.py": {
        "test_demo_runs_and_checks_itself", "test_dynamic__with_jit", "test_dynamic__without_jit",
        "test_stacked__with_jit", "test_stacked__without_jit", "test_static__with_jit",
    },
    "test_mqar.py": {"test_training_reaches_95_percent_recall_and_saves_its_outputs"},
    "test_observer.py": {
        "test_an_observed_prefill_refills_plain_rings_and_quantized_caches",
        "test_refilling_from_one_observed_prefill_equals_prefilling_at_the_budget",
    },
    "test_pages.py": {"runTest"},
    "test_retrieval.py": {
        "test_models_at_a_budget_covering_the_context_equal_the_full_cache",
        "test_smollm2_at_a_budget_covering_the_context_equals_the_full_cache",
        "test_a_budget_covering_the_context_equals_full_attention",
    },
    "test_prefix_chat.py": {
        "test_cache_file_loads_in_another_process", "test_cache_file_round_trip_in_process",
        "test_chat_cli_keeps_the_cache_across_turns_and_files",
        "test_chat_turns_continue_the_cache_and_equal_a_full_prefill",
        "test_shared_prefix_equals_whole_prompt_and_stays_usable",
    },
    "test_properties.py": {
        "test_incremental_equals_full_attention__with_jit", "test_incremental_equals_full_attention__without_jit",
    },
    "test_quantized.py": {
        "test_beam_reorder_equals_reordering_before_quantizing",
        "test_blocked_reads_equal_dequantizing_the_whole_cache", "test_cli_generates_with_a_quantized_cache",
        "test_decode_step_reads_the_store_in_blocks_and_the_residual_once",
        "test_eager_ragged_prefill_then_decode__without_jit", "test_full_attention__with_jit",
        "test_generate_with_an_int8_cache_equals_full_precision", "test_rollback_within_and_past_the_residual",
        "test_round_trip_error_is_bounded_per_group", "test_sliding_window__with_jit",
    },
    "test_qwen3_5_parity.py": {
        "test_greedy_and_sampled_generate", "test_prefill_decode_and_rollback_logits_match_transformers",
        "test_speculative_greedy_equals_plain_greedy",
    },
    "test_readme.py": {"test_api_example_runs"},
    "test_server.py": {
        "test_32_concurrent_streams_complete", "test_backpressure_answers_503_with_retry_after",
        "test_chat_completion_applies_the_template",
        "test_greedy_completion_equals_the_engine_and_streams_the_same_text", "test_models_and_health",
        "test_seeded_samples_are_reproducible_and_stop_strings_cut", "test_sigterm_drains_requests_in_flight",
    },
    "test_sharding.py": {
        "test_compiled_loops_never_move_a_cache_leaf", "test_reorder_and_rollback_keep_the_sharding",
        "test_sharded_models_equal_one_device",
    },
    "test_sharding_smollm2.py": {"test_smollm2_data_parallel_equals_one_device"},
    "test_sharding_table.py": {"test_the_script_tables_the_real_models"},
    "test_smollm2.py": {
        "test_ragged_batch_greedy_equals_transformers", "test_stop_token_ends_the_row",
        "test_unbatched_rows_equal_batched_and_decode_text",
    },
    "test_speculative.py": {
        "test_acceptance_rule_keeps_the_target_distribution",
        "test_greedy_equals_plain_greedy_for_every_cache_and_drafter",
        "test_greedy_equals_plain_greedy_with_quantized_caches",
        "test_identical_draft_model_accepts_everything_and_rows_stop_at_capacity",
        "test_sampled_generation_follows_the_target_distribution", "test_verification_stops_at_the_next_flush",
    },
    "test_speculative_gemma3.py": {"test_real_gemma3_prompt_lookup_past_the_window_equals_plain_greedy"},
    "test_weights.py": {
        "test_smollm2_gguf_config_matches_transformers", "test_smollm2_gguf_params_equal_transformers",
        "test_smollm2_logits_match_transformers", "test_tiny_logits_match_transformers",
    },
    "test_attention_backends.py": {  # Pallas kernels interpreted on CPU
        "test_engine_greedy_tokens_with_the_gpu_kernel", "test_ragged_reference_reads_a_mixed_step",
        "test_engine_under_a_mesh_with_the_gpu_kernel", "test_dense_kernels_match_the_xla_read",
        "test_generate_with_each_backend", "test_generate_under_a_mesh_with_the_gpu_kernels",
    },
    "test_bench_attention.py": {"test_smoke_on_cpu"},
    "test_kept_weights.py": {  # real models, dense and kept, loaded per module
        "test_the_file_blocks_are_kept", "test_greedy_tokens_equal_the_dense_model",
        "test_perplexity_equals_the_dense_model", "test_unrolled_layers_equal_scanned",
        "test_the_blocks_conversion_is_cached", "test_the_engine_over_kept_blocks_equals_generate",
    },
}  # fmt: skip


def _markers(item) -> list[str]:
    name, function = item.path.name, item.originalname
    marks = [item.path.parent.name]
    marks += ["parity"] * (name in PARITY_FILES) + ["multidevice"] * (name in MULTIDEVICE_FILES)
    marks += ["server"] * (name in SERVER_FILES) + ["slow"] * (function in SLOW.get(name, ()))
    return marks


def pytest_collection_modifyitems(items):
    """Markers (``_markers``), then longest-running files first (``FILE_SECONDS``); a file's own
    tests keep their order."""
    for item in items:
        for mark in _markers(item):
            item.add_marker(mark)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # a stable sort
