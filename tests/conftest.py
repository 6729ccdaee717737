import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402

torch.set_num_threads(1)


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SONNET = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
"""


@pytest.fixture
def fake_mesh():
    """A 1D mesh of 2 ranks over torch's fake process group, in this process as rank 0 (its collectives
    return at once, moving nothing): for what ``fully_shard`` checks and builds before communicating, and
    runs that only need every rank's sizes. The process group is destroyed after the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """A small text folder for the main job's tiny runs (the sonnet, and its reverse as held-out text); read
    only, so one folder serves the whole session (and ``plain_tiny_run``)."""
    folder = tmp_path_factory.mktemp("text")
    (folder / "a_sonnets.txt").write_text(SONNET * 60)
    (folder / "b_heldout.txt").write_text(SONNET[::-1] * 20)
    return folder


@pytest.fixture(scope="session")
def plain_tiny_run(tmp_path_factory, text_dir):
    """``(proc, summary)`` of the plain tiny run: ``perparam finetune`` with ``TINY`` on ``text_dir``, 2 ranks,
    fp32, no quantization, a 1D mesh, ``--summary-json``. The run the finetune tests compare theirs to
    (``test_finetune_cli``'s variants, ``test_finetune_checkpoint``'s uninterrupted run,
    ``test_finetune_offload``'s run without offload): one launch per session instead of one per file."""
    import json

    from tests.finetune_helpers import TINY, run_finetune

    out = tmp_path_factory.mktemp("plain") / "summary.json"
    proc = run_finetune(*TINY, "--text", str(text_dir), "--nproc", "2", "--summary-json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


#: ``make test-fast`` (``pytest -m fast``): the pure properties (no process), the fake-process-group tests
#: and one parity test per feature; under 3 minutes on 2 cores. An entry is a test file (all its tests),
#: ``file::test_name`` (every parametrization of that test) or ``file::test_name[id]`` (that one). ``tests/test_fast_selection.py`` checks that each
#: entry still names a test. ``make test`` (CI) runs everything, marked or not.
FAST = (
    # pure: layouts, placements, quantizers, policies, plans, layers (no process group)
    "test_layers.py", "test_public_names.py", "test_fast_selection.py",
    "test_layout_properties.py", "test_layout_2d_properties.py", "test_placement_properties.py",
    "test_auto_placement_properties.py", "test_quant_properties.py", "test_memory_formulas.py",
    "test_cast_preserves_inputs.py", "test_finetune_units.py", "test_finetune_gguf.py",
    "test_quantizers.py",
    "test_memory_plan.py::test_plan_matches_layout_per_parameter", "test_resolution_once.py",
    "test_paths.py::test_the_all_gather_chooser_takes_the_first_rule_that_holds",
    "test_paths.py::test_the_reduction_chooser_takes_the_first_rule_that_holds",
    # one process per rank through torch's fake process group
    "test_empty_shard_properties.py",
    "test_writes_seen.py::test_what_a_write_makes_stale_is_the_same_on_every_rank",
    "test_kept_copy_bookkeeping.py",
    # one parity (or count) test per feature, on gloo ranks
    "test_fully_shard_parity.py::test_nested_uneven_and_empty_shards_match_single_process[3]",
    "test_writes_seen.py::test_writes_are_seen_at_other_world_sizes_with_empty_shards",
    "test_init_matches_unsharded.py::test_initialization_after_to_empty_is_the_unsharded_models_at_any_world_size[trunc_normal]",
    "test_collective_counts.py::test_one_all_gather_per_group_and_one_reduce_scatter_per_group",
    "test_policies.py::test_mixed_policy_group_trains_like_a_reference_with_the_same_casts[bf16]",
    "test_hsdp.py::test_hsdp_2x2_equals_fsdp_and_single_process",
    "test_tensor_parallel.py::test_fsdp_plus_tp_matches_a_single_process[mixed]",
    "test_runtime_routes.py::test_the_manual_unshard_path_reduces_gradients_exactly_once",
    "test_rank_dependent_use.py::test_ranks_using_different_parameters_get_the_averaged_gradient[3]",
    "test_precision_islands.py::test_a_linear_asked_to_compute_in_fp32_inside_a_bf16_call_is_an_island[2-False]",
    "test_nf4.py::test_nf4_unshards_to_the_expected_dequantized_weights[stored-3]",
    "test_zero_dim_params.py::test_0_dim_parameters_replicated_train_like_one_process",
    "test_full_state_dict.py::test_load_full_state_dict_from_rank_0_into_a_meta_device_sharded_model",
    "test_meta_assign_load.py::test_a_meta_model_loaded_with_assign_keeps_its_parameters_and_trains_like_one_process[dtensor-4]",
    "test_stored_dtype.py::test_a_float_cast_after_fully_shard_casts_the_shards_and_trains_like_one_process_cast_alike[to-after_step-2-3]",
    "test_fsdp2_api_parity.py::test_an_optimizer_built_before_sharding_trains_exactly_like_one_built_after",
    "test_iteration_context.py::test_two_models_in_one_process_keep_their_own_iteration_state",
    "test_no_import_side_effects.py::test_only_steps_of_optimizers_holding_perparam_parameters_mark_kept_parameters_stale[3]",
    "test_no_import_side_effects.py::test_configure_returns_the_previous_config_and_refuses_bad_settings",
    "test_fully_shard_errors.py",
    "test_custom_collectives.py::test_custom_all_gather_and_reduce_scatter_train_like_perparams_own[3]",
    "test_clip_grad_norm.py::test_weighted_local_contributions_sum_to_the_norm_of_every_distinct_element",
    "test_clip_grad_norm.py::test_expert_meshes_give_the_one_process_norm_on_every_rank_and_clip_alike",
    "test_expert_parallel.py::test_expert_gradients_match_one_process_with_divide_factor",
    "test_post_accumulate_grad_hooks.py::test_an_optimizer_stepped_in_the_hooks_matches_one_process",
    "test_torch_utilities_after_sharding.py::test_utilities_perparam_cannot_follow_are_refused_at_the_call_leaving_the_model_as_it_was",
    "test_modules_reading_child_weights.py::test_sharding_a_child_its_stock_parent_reads_directly_is_refused_at_fully_shard",
    "test_fsdp2_refusal_types.py::test_a_module_list_or_dict_given_as_a_module_is_refused_and_its_modules_as_a_list_match_one_process",
    "test_norm_buffers_precision.py::test_norms_with_running_statistics_run_under_bf16_param_dtype_in_fp32",
    "test_finetune_evaluation.py::test_unequal_no_grad_batches_finish_with_the_results_of_one_process",
    "test_finetune_peers.py",
    "test_zero_stages.py::test_collectives_per_step_of_each_stage",
    "test_invariant_training.py::test_invariant_units_give_bitwise_equal_parameters_on_1_2_and_4_ranks",
    "test_invariant_tree_properties.py",
    "test_hpz.py::test_hpz_backward_all_gathers_stay_on_the_secondary_group_with_zeropp_bytes_and_memory",
    "test_requires_all_reduce.py",
    "test_explicit_prefetch.py::test_a_prefetch_list_with_an_unsharded_or_foreign_module_is_refused_naming_it",
    "test_async_checkpoint.py::test_async_save_snapshots_the_state_while_training_continues_and_loads_bit_exact",
    "test_compute_dtype_choice.py",
    "test_fsdp_managed_marks.py",
    "test_threaded_ranks.py",
    "test_unsharded_contiguous.py",
    "test_zero_copy_gather.py",
    "test_local_optimizer_step.py",
    "test_owner_plan_properties.py",
    "test_whole_matrix.py::test_the_owner_update_is_bitwise_torch_muon_on_the_gathered_gradient[2]",
    "test_whole_matrix.py::test_muon_on_hsdp_2x2_trains_like_one_process",
    "test_whole_matrix.py::test_a_whole_matrix_optimizer_on_shards_without_the_owner_policy_is_refused_at_its_first_step",
    "test_grad_quant.py::test_int8_and_bf16_reduce_scatter_errors_stay_within_their_block_bounds_one_collective_per_format[2]",
    "test_grad_quant.py::test_grad_quant_that_cannot_apply_is_refused_at_fully_shard_naming_the_parameter",
    "test_param_mesh.py::test_one_call_issues_one_all_gather_per_mesh_and_one_reduce_scatter_per_mesh_and_dtype",
    "test_offload_plan.py::test_a_zero_budget_offloads_shards_gradients_and_optimizer_state_and_kept_copies_say_nothing_fits",
    "test_offload.py::test_tiers_a_cuda_mesh_cannot_have_are_refused_naming_what_to_use_instead",
    "test_torch_utilities_after_sharding.py::test_lbfgs_on_an_unevenly_sharded_parameter_is_refused",
    "test_param_mesh.py::test_full_state_dicts_of_experts_on_per_rank_meshes_are_refused_on_every_rank_naming_them",
    "test_tied_aliases.py", "test_checked_at_fully_shard.py",
    "test_zero_copy_reduce_scatter.py::test_zero_copy_reduce_scatter_is_bitwise_the_packed_one_on_empty_uneven_mixed_dtype_and_no_sync[3]",
    "test_zero_copy_reduce_scatter.py::test_division_fused_into_the_cast_or_the_accumulation_is_bitwise_dividing_first",
    "test_apply_between_steps.py::test_to_empty_on_a_plain_submodule_refreshes_kept_copies_of_stages_1_and_2",
    "test_apply_between_steps.py::test_dcp_load_in_place_without_load_state_dict_is_refused_until_the_kept_storage_is_refreshed",
    "test_cli_errors.py::test_plan_budget_flags_are_checked_before_planning_in_one_line",
    "test_zero_stages.py::test_a_frozen_parameter_an_optimizer_still_steps_has_its_kept_copy_refreshed",
    "test_torch_versions.py", "test_device_selection.py",
    "test_host_syncs.py::test_only_a_rank_that_lacked_a_gradient_reads_the_summed_flags_back",
    "test_hf_trainer.py::test_the_private_trainer_methods_the_piece_overrides_are_unchanged",
    "test_hf_trainer.py::test_the_pieces_refuse_a_model_with_trainable_parameters_no_fully_shard_call_manages",
    "test_gpu_accelerate.py::test_torch_fsdp2_policies_convert_to_perparams",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        file, _, rest = item.nodeid.removeprefix("tests/").partition("::")
        if any(_selects(entry, file, rest) for entry in FAST):
            item.add_marker(pytest.mark.fast)


def _selects(entry: str, file: str, test: str) -> bool:
    """Whether FAST's ``entry`` selects ``file::test`` (``test`` with its parametrization id, if any)."""
    entry_file, _, entry_test = entry.partition("::")
    if entry_file != file:
        return False
    if not entry_test:
        return True
    if "[" in entry_test:
        return test == entry_test
    return test.split("[")[0].startswith(entry_test)
