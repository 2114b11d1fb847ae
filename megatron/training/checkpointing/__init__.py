"""Saving and loading checkpoints (megatron.training.checkpointing): the entry points, dispatching on the format.

``--ckpt-format torch`` is Megatron-LM's one-file-per-rank layout (:mod:`.torch_format`); ``--ckpt-format
torch_dist`` is Megatron-LM's distributed checkpoint, reshardable on load (:mod:`.torch_dist`, built on
megatron.core.dist_checkpointing and the modules' ``sharded_state_dict``; the optimizer state in :mod:`.dist_state`
and its read checks in :mod:`.dist_strictness`); ``torch_dcp`` (:mod:`.torch_dcp`, ``--use-torch-fsdp2``) and
``fsdp_dtensor`` (:mod:`.fsdp_dtensor`, ``--use-megatron-fsdp``) are the DCP formats of the fully sharded models. All
write through the same crash-safe save protocol (:mod:`.protocol`: staging directory, fsync'ed atomic files,
renames, the tracker written last, every rank agreeing on each step) and store the same RNG state (:mod:`.rng`).
``--auto-detect-ckpt-format`` loads whichever format the checkpoint directory holds (``metadata.json``: torch_dist;
``mp_rank_*`` directories: torch).

Imports go one way only: this module imports the formats; the formats import protocol and rng (torch_dist also
its own dist_* modules); protocol imports neither. The torch_dist modules (which pull in
``torch.distributed.checkpoint``) are imported on first use.
"""
from __future__ import annotations

import os

from megatron.training.checkpointing import torch_format
from megatron.training.checkpointing.protocol import (ASIDE_SUFFIX, STAGING_SUFFIX, TRACKER_BASENAME,
                                                      CheckpointError, agree_on_save_step, check_checkpoint_args,
                                                      checkpoint_exists, describe_save_error,
                                                      get_checkpoint_tracker_filename, locate, read_metadata)
from megatron.training.checkpointing.rerun_state import KEY as RERUN_KEY
from megatron.training.checkpointing.rerun_state import gather_rerun_state
from megatron.training.checkpointing.rerun_state import pending as pending_rerun
from megatron.training.checkpointing.rng import get_rng_state
from megatron.training.checkpointing.torch_format import (CHECKPOINT_VERSION, MODEL_BASENAME,
                                                          find_checkpoint_rank_0, get_checkpoint_name,
                                                          get_distributed_optimizer_checkpoint_name)
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0

__all__ = ["ASIDE_SUFFIX", "CHECKPOINT_VERSION", "MODEL_BASENAME", "STAGING_SUFFIX", "TRACKER_BASENAME",
           "CheckpointError", "agree_on_save_step", "check_checkpoint_args", "describe_save_error",
           "find_checkpoint_rank_0", "get_checkpoint_name", "get_checkpoint_tracker_filename",
           "get_distributed_optimizer_checkpoint_name", "get_rng_state", "load_args_from_checkpoint",
           "load_checkpoint", "load_format", "read_metadata", "save_checkpoint"]


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=None):
    """Write checkpoint ``iteration`` under ``--save`` in ``--ckpt-format`` (a collective: every rank calls it)
    and update the tracker once every rank's files are on disk."""
    args = get_args()
    if num_floating_point_operations_so_far is None:
        num_floating_point_operations_so_far = getattr(args, "num_floating_point_operations_so_far", 0)
    if getattr(args, "fake_process_group", False):
        print_rank_0(f"--fake-process-group: not saving checkpoint {iteration} to {args.save} (this process is one "
                     "rank of a simulated job: its values are meaningless and the other ranks' files would be missing)")
        return
    rerun = gather_rerun_state()  # every rank's rerun state machine (checkpointing/rerun_state.py)
    if args.ckpt_format == "torch_dist":
        return _dcp_format("torch_dist").save(iteration, model, optimizer, opt_param_scheduler,
                                              num_floating_point_operations_so_far, {RERUN_KEY: rerun})
    if args.ckpt_format in _DCP_FORMATS:  # torch_dcp, fsdp_dtensor (Megatron keeps the machine in torch_dist only)
        return _dcp_format(args.ckpt_format).save(iteration, model, optimizer, opt_param_scheduler,
                                                  num_floating_point_operations_so_far)
    if args.ckpt_format is None:
        raise CheckpointError("no --ckpt-format to save in (a task script leaves it to the task's model): pass "
                              "--ckpt-format torch or torch_dist")
    if getattr(args, "ckpt_format", "torch") != "torch":
        raise CheckpointError(f"--ckpt-format {args.ckpt_format} is not supported by this saver; "
                              "use --ckpt-format torch")
    return torch_format.save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                             {RERUN_KEY: rerun if pending_rerun(rerun) else None})


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Load ``--load`` (or ``--pretrained-checkpoint`` when ``--load`` has none) into model, optimizer, scheduler
    and RNG; set ``args.num_floating_point_operations_so_far``; return the iteration to resume from."""
    args = get_args()
    fmt = load_format(args, getattr(args, load_arg))
    if fmt in _DCP_FORMATS:
        return _dcp_format(fmt).load(model, optimizer, opt_param_scheduler, load_arg, strict)
    return torch_format.load(model, optimizer, opt_param_scheduler, load_arg, strict)


# The formats written with PyTorch DCP, each in its module (imported on first use).
_DCP_FORMATS = ("torch_dist", "torch_dcp", "fsdp_dtensor")


def _dcp_format(name):
    import importlib

    return importlib.import_module(f"megatron.training.checkpointing.{name}")


def detect_format(iter_dir):
    """The format of a checkpoint directory: torch_dist (metadata.json), fsdp_dtensor / torch_dcp (a DCP .metadata
    without it: fsdp_dtensor's keys start with ``model.module.``), torch (mp_rank_* files), else None."""
    if os.path.isfile(os.path.join(iter_dir, "metadata.json")):
        return "torch_dist"
    if os.path.isfile(os.path.join(iter_dir, ".metadata")):
        import torch.distributed.checkpoint as dcp

        keys = dcp.FileSystemReader(iter_dir).read_metadata().state_dict_metadata
        return "fsdp_dtensor" if any(k.startswith("model.module.") for k in keys) else "torch_dcp"
    return "torch" if torch_format.saved_layout(iter_dir) is not None else None


def load_format(args, load_dir):
    """--ckpt-format, or with --auto-detect-ckpt-format the format the tracker's checkpoint directory holds."""
    if not getattr(args, "auto_detect_ckpt_format", False) or not checkpoint_exists(load_dir):
        return args.ckpt_format
    try:
        _, _, iter_dir = locate(load_dir, getattr(args, "ckpt_step", None))
    except CheckpointError:
        return args.ckpt_format
    detected = detect_format(iter_dir) or args.ckpt_format
    print_rank_0(f" --auto-detect-ckpt-format: {iter_dir} holds a {detected} checkpoint")
    return detected


def load_args_from_checkpoint(args, load_arg="load"):
    """``--use-checkpoint-args``: before validate_args, overwrite the model-shape flags with those stored in the
    rank-0 file of the checkpoint in ``args.<load_arg>``. Flags marked forced always take the checkpoint's
    value; the others only fill flags the command line left unset. Returns (args, checkpoint_args)."""
    load_dir = getattr(args, load_arg)
    if load_dir is None:
        raise CheckpointError("--use-checkpoint-args needs --load: pass the checkpoint directory")
    if not checkpoint_exists(load_dir) and getattr(args, "ckpt_step", None) is None:
        raise CheckpointError(f"--use-checkpoint-args: no checkpoint in --load {load_dir} "
                              f"({get_checkpoint_tracker_filename(load_dir)} does not exist)")

    def read_tracker_locally(tracker):  # no process group exists yet: no all-reduce
        with open(tracker) as f:
            text = f.read().strip()
        return (0, True) if text == "release" else (int(text), False)

    try:
        iteration, release, iter_dir = locate(load_dir, getattr(args, "ckpt_step", None), read_tracker_locally)
    except ValueError as e:
        raise CheckpointError(f"{get_checkpoint_tracker_filename(load_dir)}: {e}") from e
    checkpoint_name = find_checkpoint_rank_0(load_dir, iteration, release)
    if checkpoint_name is None and os.path.isfile(os.path.join(iter_dir, "metadata.json")):  # torch_dist
        checkpoint_name = os.path.join(iter_dir, "common.pt")
    if checkpoint_name is None and iter_dir.endswith(ASIDE_SUFFIX):
        for rank_dir in ("mp_rank_00", "mp_rank_00_000"):
            if os.path.isfile(os.path.join(iter_dir, rank_dir, MODEL_BASENAME)):
                checkpoint_name = os.path.join(iter_dir, rank_dir, MODEL_BASENAME)
    if checkpoint_name is None:
        raise CheckpointError(f"--use-checkpoint-args: {iter_dir} has no mp_rank_00[_000]/{MODEL_BASENAME}")
    if checkpoint_name.endswith("common.pt"):
        from megatron.training.checkpointing.dist_state import read_common
        state_dict = read_common(iter_dir)
    else:
        state_dict = torch_format.read_checkpoint_file(checkpoint_name)
    checkpoint_args = state_dict.get("args")
    if checkpoint_args is None:
        raise CheckpointError(f"--use-checkpoint-args: {checkpoint_name} holds no 'args' entry")
    version = state_dict.get("checkpoint_version", 0)

    def set_arg(name, old_name=None, force=False):
        if not force and getattr(args, name, None) is not None:
            return
        value = getattr(checkpoint_args, old_name or name, None)
        if value is not None or force:
            setattr(args, name, value)

    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "kv_channels",
                 "max_position_embeddings", "tokenizer_type", "padded_vocab_size",
                 "num_layers_per_virtual_pipeline_stage"):
        set_arg(name)
    for name in ("num_query_groups", "group_query_attention", "position_embedding_type", "add_position_embedding",
                 "use_rotary_position_embeddings", "rotary_percent", "add_bias_linear", "swiglu",
                 "untie_embeddings_and_output_weights", "layernorm_zero_centered_gamma", "normalization"):
        if hasattr(checkpoint_args, name):
            set_arg(name, force=True)
    if hasattr(checkpoint_args, "apply_layernorm_1p"):  # the 2023 destination of --apply-layernorm-1p
        set_arg("layernorm_zero_centered_gamma", "apply_layernorm_1p", force=True)
    # Mixture of experts (Megatron force-copies these; the dispatcher only when unset).
    set_arg("moe_token_dispatcher_type")
    for name in ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
                 "moe_grouped_gemm", "moe_shared_expert_intermediate_size", "moe_router_score_function",
                 "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor"):
        if hasattr(checkpoint_args, name):
            set_arg(name, force=True)
    # Hybrid Mamba models: the layer pattern decides the model's layers, the Mamba sizes its mixers.
    for name in ("hybrid_layer_pattern", "hybrid_override_pattern", "is_hybrid_model", "mamba_state_dim",
                 "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "squared_relu", "moe_latent_size"):
        if hasattr(checkpoint_args, name):
            set_arg(name, force=True)
    if version < 3.0:
        set_arg("tensor_model_parallel_size", "model_parallel_size", force=True)
    else:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size"):
            set_arg(name, force=True)
    return args, checkpoint_args
