"""Saving and loading checkpoints in Megatron-LM's ``torch`` layout (megatron.training.checkpointing).

::

    <save>/latest_checkpointed_iteration.txt          "<iteration>" or "release"
    <save>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/iter_0000100/mp_rank_TT[_PPP]/distrib_optim.pt   (--use-distributed-optimizer)

The ``_PPP`` suffix appears iff the pipeline size is > 1. Only data-parallel rank 0 of each (TP, PP)
position writes ``model_optim_rng.pt``.

Crash safety: every rank writes its files into a staging directory ``<save>/iter_0000100.incomplete``
(each file to a temporary name, fsync'ed, then renamed). After a barrier, global rank 0 renames the staging
directory to ``iter_0000100`` and only then rewrites the tracker (temporary name, fsync, rename). A process
killed at any point therefore leaves the tracker pointing at the previous, complete checkpoint; re-saving
an iteration that already exists moves the old copy aside (``.old``) until the new one is in place, and the
loader falls back to it if a crash came in between.

Failures agree across ranks: after each step of a save every rank reports whether it failed (an all-reduce,
which also synchronises like a barrier), so a rank whose disk is full does not leave the others waiting in a
barrier. Every rank then raises the same one-line :class:`CheckpointError` naming the checkpoint directory, the
failing rank and the cause ("no space left on device ..."); the staging directory is removed and the tracker is
left as it was.
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import sys

import numpy as np
import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.training.errors import FatalRunError
from megatron.training.global_vars import get_args
from megatron.training.utils import is_rank_0, print_rank_0, unwrap_model

CHECKPOINT_VERSION = 3.0
TRACKER_BASENAME = "latest_checkpointed_iteration.txt"
MODEL_BASENAME = "model_optim_rng.pt"
STAGING_SUFFIX = ".incomplete"
ASIDE_SUFFIX = ".old"
_CHECKED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                 "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class CheckpointError(FatalRunError):
    """A checkpoint that cannot be read or does not match the run; the message names the file."""


def _save_stage(stage: str, path: str) -> None:
    """Called at each step of a save (stage names: 'file-temp-written', 'file-renamed', 'all-files-written',
    'previous-copy-moved-aside', 'iteration-dir-renamed', 'tracker-temp-written', 'tracker-renamed').
    A no-op; tests replace it to kill the process in the middle of a save."""


# ------------------------------------------------------------------------------------------- names

def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER_BASENAME)


def _iteration_dirname(iteration, release=False):
    return "release" if release else "iter_{:07d}".format(iteration)


def _rank_dirname(tensor_rank, pipeline_rank, pipeline_parallel):
    if pipeline_parallel:
        return "mp_rank_{:02d}_{:03d}".format(tensor_rank, pipeline_rank)
    return "mp_rank_{:02d}".format(tensor_rank)


def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None, tensor_rank=None,
                        pipeline_rank=None, basename=MODEL_BASENAME):
    """Path of one rank's checkpoint file."""
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    return os.path.join(checkpoints_path, _iteration_dirname(iteration, release),
                        _rank_dirname(tensor_rank, pipeline_rank, pipeline_parallel), basename)


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name):
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def find_checkpoint_rank_0(checkpoints_path, iteration, release=False):
    """The rank-0 file of a checkpoint, with or without the pipeline suffix; None if neither exists."""
    for pipeline_parallel in (False, True):
        name = get_checkpoint_name(checkpoints_path, iteration, release, pipeline_parallel, 0, 0)
        if os.path.isfile(name):
            return name
    return None


# ------------------------------------------------------------------------------------ atomic files

def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


def _atomic_write(path, mode, write, stage):
    """Write to a temporary name, fsync, rename: ``path`` is either absent or complete.

    ``stage`` ("file" or "tracker") names the ``_save_stage`` hooks passed on the way.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp.{}".format(os.getpid())
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        try:
            os.remove(tmp)  # a full disk: do not leave a partial temporary file behind
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is None:  # say which file (torch.save's errors do not)
            raise OSError(e.errno, e.strerror, tmp) from e
        raise
    _save_stage(f"{stage}-temp-written", tmp)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))
    _save_stage(f"{stage}-renamed", path)


def _atomic_torch_save(obj, path):
    _atomic_write(path, "wb", lambda f: torch.save(obj, f), "file")


def _atomic_write_text(path, text):
    _atomic_write(path, "w", lambda f: f.write(text), "tracker")


def read_metadata(tracker_filename):
    """(iteration, release) from the tracker file; every rank agrees on the maximum."""
    try:
        with open(tracker_filename) as f:
            text = f.read().strip()
    except OSError as e:
        raise CheckpointError(f"could not read checkpoint tracker {tracker_filename}: {e}") from e
    release = text == "release"
    if release:
        iteration = 0
    else:
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointError(f"metadata file {tracker_filename} must hold an iteration number or 'release', "
                                  f"found {text!r}") from None
    if torch.distributed.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long, device=device.current_device())
        torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
        max_iter = int(iters.item())
        if max_iter != iteration:
            print("WARNING: on rank {} found iteration {} in the metadata while max iteration across the ranks "
                  "is {}, replacing it with max iteration.".format(torch.distributed.get_rank(), iteration, max_iter),
                  flush=True)
            iteration = max_iter
    return iteration, release


# ---------------------------------------------------------------------------------------------- RNG

def get_rng_state(data_parallel_random_init=False):
    """This rank's RNG states (a list over the DP group when DP ranks were initialised differently)."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if data_parallel_random_init and torch.distributed.is_initialized():
        states = [None] * parallel_state.get_data_parallel_world_size()
        torch.distributed.all_gather_object(states, state, group=parallel_state.get_data_parallel_group())
        return states
    return [state]


def _set_rng_state(rng_states, data_parallel_random_init, checkpoint_name):
    if data_parallel_random_init:
        dp_rank = parallel_state.get_data_parallel_rank()
        if dp_rank >= len(rng_states):
            raise CheckpointError(f"{checkpoint_name} holds RNG states for {len(rng_states)} data-parallel ranks "
                                  f"but this run has data-parallel rank {dp_rank}; pass --no-load-rng")
        state = rng_states[dp_rank]
    else:
        state = rng_states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    device.set_rng_state(state["cuda_rng_state"])
    if not state["rng_tracker_states"]:
        raise CheckpointError(f"the rng_tracker_states of {checkpoint_name} is empty; pass --no-load-rng")
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


# --------------------------------------------------------------------------------------------- save

def _model_state(chunk):
    if hasattr(chunk, "state_dict_for_save_checkpoint"):
        return chunk.state_dict_for_save_checkpoint()
    return chunk.state_dict()


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def describe_save_error(error: BaseException):
    """(rank the failure happened on, when the error says so, else None; one line). A full disk reads
    "no space left on device (<file>)". DCP reports every rank's failure, keyed by rank, on every rank."""
    causes, seen = [(None, error)], set()
    while causes:
        origin, e = causes.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return origin, f"no space left on device ({e.filename or e.strerror})"
        for rank, failure in (getattr(e, "failures", None) or {}).items():
            causes.append((rank, failure[0] if isinstance(failure, tuple) else failure))
        for inner in (e.__cause__, e.__context__):
            if inner is not None:
                causes.append((origin, inner))
    text = " ".join(str(error).split())
    return None, f"{type(error).__name__}: {text[:300]}"


def agree_on_save_step(error, save_dir, iteration, group=None, on_failure=None):
    """Collective over ``group``: raise the same CheckpointError on every rank when any rank's ``error`` is set.

    Every rank calls it after each step of a save (it also synchronises them, as a barrier would). Before
    raising, global rank 0 runs ``on_failure`` (the clean-up of the failed save)."""
    my_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    mine = None
    if error is not None:
        origin, text = describe_save_error(error)
        mine = (my_rank if origin is None else origin, text)
    failing = [mine] if mine is not None else []
    if torch.distributed.is_initialized():
        on_device = group is None and torch.distributed.get_backend() != "gloo"
        flag = torch.tensor([0 if error is None else 1], dtype=torch.long,
                            device=device.current_device() if on_device else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        if flag.item() == 0:
            return
        reports = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(reports, mine, group=group)
        failing = sorted(r for r in reports if r is not None)
    if not failing:
        return
    if on_failure is not None and is_rank_0():
        try:
            on_failure()
        except OSError:
            pass  # best effort: the next save sweeps what is left
    rank, message = failing[0]
    raise CheckpointError(f"saving checkpoint iteration {iteration} to {save_dir} failed on rank {rank}: {message}; "
                          f"the previous checkpoint and {TRACKER_BASENAME} are unchanged",
                          same_on_every_rank=True) from error


def _run_step(step):
    """Run ``step()``; return the exception it raised (None when it succeeded)."""
    try:
        step()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - reported to every rank by agree_on_save_step (DCP's
        return e                # CheckpointException is a BaseException)
    return None


def _prepare_save_dir(save_dir, iteration):
    """Rank 0, before any rank writes: sweep the debris of interrupted saves (staging directories; copies
    moved aside, which are put back when their replacement never arrived) and create the staging directory."""
    if os.path.isdir(save_dir):
        for name in os.listdir(save_dir):
            path = os.path.join(save_dir, name)
            if name.startswith(TRACKER_BASENAME + ".tmp."):
                os.remove(path)  # a tracker update killed before its rename
            elif name.endswith(STAGING_SUFFIX) and os.path.isdir(path):
                shutil.rmtree(path)
            elif name.endswith(ASIDE_SUFFIX) and os.path.isdir(path):
                original = path[:-len(ASIDE_SUFFIX)]
                if os.path.isdir(original):
                    shutil.rmtree(path)  # the re-save finished its rename: this copy is superseded
                else:
                    os.replace(path, original)
    final = os.path.join(save_dir, _iteration_dirname(iteration))
    staging = final + STAGING_SUFFIX
    os.makedirs(staging, exist_ok=True)
    return final, staging


def _publish(save_dir, final, staging, iteration):
    """Rank 0, after every rank has written its files: move the staging directory into place, then point the
    tracker at it. An existing copy of the same iteration stays on disk (as ``.old``) until both are done."""
    aside = final + ASIDE_SUFFIX
    if os.path.isdir(final):
        os.replace(final, aside)
        _save_stage("previous-copy-moved-aside", aside)
    os.replace(staging, final)
    _fsync_dir(save_dir)
    _save_stage("iteration-dir-renamed", final)
    _atomic_write_text(get_checkpoint_tracker_filename(save_dir), str(iteration))
    if os.path.isdir(aside):
        shutil.rmtree(aside)


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=None):
    """Write checkpoint ``iteration`` under ``--save`` (a collective: every rank calls it) and update the
    tracker once every rank's files are on disk."""
    args = get_args()
    if num_floating_point_operations_so_far is None:
        num_floating_point_operations_so_far = getattr(args, "num_floating_point_operations_so_far", 0)
    if args.ckpt_format == "torch_dist":
        from megatron.training import dist_checkpointing
        return dist_checkpointing.save(iteration, model, optimizer, opt_param_scheduler,
                                       num_floating_point_operations_so_far)
    if getattr(args, "ckpt_format", "torch") != "torch":
        raise CheckpointError(f"--ckpt-format {args.ckpt_format} is not supported by this saver; "
                              "use --ckpt-format torch")
    model = unwrap_model(model)
    print_rank_0("saving checkpoint at iteration {:7d} to {}".format(iteration, args.save))
    rng_state = None if args.no_save_rng else get_rng_state(args.data_parallel_random_init)

    final = os.path.join(args.save, _iteration_dirname(iteration))
    staging = final + STAGING_SUFFIX

    def remove_staging():
        shutil.rmtree(staging, ignore_errors=True)

    error = _run_step(lambda: _prepare_save_dir(args.save, iteration)) if is_rank_0() else None
    agree_on_save_step(error, args.save, iteration, on_failure=remove_staging)
    checkpoint_name = get_checkpoint_name(args.save, iteration)
    staged_name = os.path.join(staging, os.path.relpath(checkpoint_name, os.path.join(
        args.save, _iteration_dirname(iteration))))

    state = None
    if args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None:
        # Collective over the DP group: every DP rank contributes its shard, DP rank 0 writes the file.
        state = optimizer.get_parameter_state()
    error = None
    if parallel_state.get_data_parallel_rank() == 0:
        error = _run_step(lambda: _write_rank_files(args, iteration, model, optimizer, opt_param_scheduler,
                                                    rng_state, num_floating_point_operations_so_far, staged_name,
                                                    state))
    # Every rank has fsync'ed and renamed its files (or failed) once this returns.
    agree_on_save_step(error, args.save, iteration, on_failure=remove_staging)
    error = None
    if is_rank_0():
        _save_stage("all-files-written", staging)
        error = _run_step(lambda: _publish(args.save, final, staging, iteration))
    agree_on_save_step(error, args.save, iteration, on_failure=remove_staging)
    print_rank_0("  successfully saved checkpoint at iteration {:7d} to {}".format(iteration, args.save))


def _write_rank_files(args, iteration, model, optimizer, opt_param_scheduler, rng_state,
                      num_floating_point_operations_so_far, staged_name, optim_state):
    """Data-parallel rank 0 of each (TP, PP) position: write its files into the staging directory."""
    if optim_state is not None:
        _atomic_torch_save(optim_state, get_distributed_optimizer_checkpoint_name(staged_name))
    state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    if len(model) == 1:
        state_dict["model"] = _model_state(model[0])
    else:
        for i, chunk in enumerate(model):
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
            state_dict["model%d" % i] = _model_state(chunk)
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    if not args.no_save_optim:
        if optimizer is not None:
            state_dict["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    state_dict["num_floating_point_operations_so_far"] = float(num_floating_point_operations_so_far)
    _atomic_torch_save(state_dict, staged_name)


# --------------------------------------------------------------------------------------------- load

def _checkpoint_exists(load_dir):
    return load_dir is not None and os.path.isfile(get_checkpoint_tracker_filename(load_dir))


def _locate(load_dir, ckpt_step, read_tracker=read_metadata):
    """(iteration, release, iteration directory) of the checkpoint to load from ``load_dir``."""
    if ckpt_step is not None:
        iteration, release = ckpt_step, False
    else:
        iteration, release = read_tracker(get_checkpoint_tracker_filename(load_dir))
    iter_dir = os.path.join(load_dir, _iteration_dirname(iteration, release))
    if not os.path.isdir(iter_dir) and os.path.isdir(iter_dir + ASIDE_SUFFIX):
        iter_dir += ASIDE_SUFFIX  # a re-save of this iteration was interrupted between its two renames
    if not os.path.isdir(iter_dir):
        source = f"--ckpt-step {ckpt_step}" if ckpt_step is not None else get_checkpoint_tracker_filename(load_dir)
        raise CheckpointError(f"checkpoint directory {iter_dir} (named by {source}) does not exist")
    return iteration, release, iter_dir


def _saved_layout(iter_dir):
    """(tensor, pipeline) model parallel sizes a torch-format checkpoint was saved with, from its rank
    directories; None when the directory holds none."""
    tp, pp, found = 0, 0, False
    for name in os.listdir(iter_dir):
        m = _RANK_DIR.match(name)
        if m:
            found = True
            tp = max(tp, int(m.group(1)) + 1)
            pp = max(pp, int(m.group(2)) + 1 if m.group(2) is not None else 1)
    return (tp, pp) if found else None


def _check_layout(iter_dir, checkpoint_name):
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    saved = _saved_layout(iter_dir)
    if saved is None:
        raise CheckpointError(f"checkpoint file {checkpoint_name} does not exist: {iter_dir} holds no mp_rank_* "
                              f"directory (is it a --ckpt-format torch checkpoint?)")
    if saved != (tp, pp):
        raise CheckpointError(
            f"checkpoint {iter_dir} was saved with tensor/pipeline model parallel sizes (TP={saved[0]}, "
            f"PP={saved[1]}) but this run uses (TP={tp}, PP={pp}), so its mp_rank_*/{MODEL_BASENAME} files do not "
            f"match this run's ranks. A --ckpt-format torch checkpoint only loads "
            f"with the layout it was saved with: convert it with tools/checkpoint/convert.py "
            f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}, or save with --ckpt-format "
            f"torch_dist, which reshards on load", same_on_every_rank=True)
    if not os.path.isfile(checkpoint_name):
        raise CheckpointError(f"checkpoint file {checkpoint_name} is missing (the save that wrote {iter_dir} "
                              f"did not complete, or the file was removed)")


def _read_checkpoint_file(checkpoint_name):
    try:
        return torch.load(checkpoint_name, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - corrupt or truncated file: say which
        raise CheckpointError(f"could not read checkpoint file {checkpoint_name} (corrupt or truncated?): "
                              f"{type(e).__name__}: {e}") from e


def load_args_from_checkpoint(args, load_arg="load"):
    """``--use-checkpoint-args``: before validate_args, overwrite the model-shape flags with those stored in the
    rank-0 file of the checkpoint in ``args.<load_arg>``. Flags marked forced always take the checkpoint's
    value; the others only fill flags the command line left unset. Returns (args, checkpoint_args)."""
    load_dir = getattr(args, load_arg)
    if load_dir is None:
        raise CheckpointError("--use-checkpoint-args needs --load: pass the checkpoint directory")
    if not _checkpoint_exists(load_dir) and getattr(args, "ckpt_step", None) is None:
        raise CheckpointError(f"--use-checkpoint-args: no checkpoint in --load {load_dir} "
                              f"({get_checkpoint_tracker_filename(load_dir)} does not exist)")

    def read_tracker_locally(tracker):  # no process group exists yet: no all-reduce
        with open(tracker) as f:
            text = f.read().strip()
        return (0, True) if text == "release" else (int(text), False)

    try:
        iteration, release, iter_dir = _locate(load_dir, getattr(args, "ckpt_step", None), read_tracker_locally)
    except ValueError as e:
        raise CheckpointError(f"{get_checkpoint_tracker_filename(load_dir)}: {e}") from e
    checkpoint_name = find_checkpoint_rank_0(load_dir, iteration, release)
    if checkpoint_name is None and os.path.isfile(os.path.join(iter_dir, "metadata.json")):  # torch_dist
        from megatron.training.dist_checkpointing import read_common
        checkpoint_name = os.path.join(iter_dir, "common.pt")
    if checkpoint_name is None and iter_dir.endswith(ASIDE_SUFFIX):
        for rank_dir in ("mp_rank_00", "mp_rank_00_000"):
            if os.path.isfile(os.path.join(iter_dir, rank_dir, MODEL_BASENAME)):
                checkpoint_name = os.path.join(iter_dir, rank_dir, MODEL_BASENAME)
    if checkpoint_name is None:
        raise CheckpointError(f"--use-checkpoint-args: {iter_dir} has no mp_rank_00[_000]/{MODEL_BASENAME}")
    state_dict = read_common(iter_dir) if checkpoint_name.endswith("common.pt") else _read_checkpoint_file(checkpoint_name)
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
                 "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization"):
        if hasattr(checkpoint_args, name):
            set_arg(name, force=True)
    if version < 3.0:
        set_arg("tensor_model_parallel_size", "model_parallel_size", force=True)
    else:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "virtual_pipeline_model_parallel_size"):
            set_arg(name, force=True)
    return args, checkpoint_args


def check_checkpoint_args(checkpoint_args, checkpoint_name=None, skip=()):
    """The model shape must match the checkpoint's (Megatron's check). Every mismatching flag is listed in one
    line with the checkpoint path, instead of a tensor size-mismatch traceback later."""
    args = get_args()
    mismatches = []
    for name in _CHECKED_ARGS:
        if name in skip:
            continue
        if name in ("max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size",
                    "tokenizer_type") and not getattr(args, "vocab_file", None):
            continue
        ckpt_value, value = getattr(checkpoint_args, name, None), getattr(args, name, None)
        if ckpt_value is not None and ckpt_value != value:
            mismatches.append(f"--{name.replace('_', '-')} is {value} here but {ckpt_value} in the checkpoint")
    if mismatches:
        where = f"checkpoint {checkpoint_name}" if checkpoint_name else "the checkpoint"
        raise CheckpointError(
            f"{where} was saved from a model of another shape: {'; '.join(mismatches)}. Pass the checkpoint's "
            "values (or --use-checkpoint-args), or --finetune to load only matching weights", same_on_every_rank=True)


def _load_model(model, state_dict, checkpoint_name, strict):
    keys = ["model"] if len(model) == 1 else ["model%d" % i for i in range(len(model))]
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise CheckpointError(f"{checkpoint_name} has no {missing} entry (it holds {sorted(state_dict)}): it was saved "
                              f"with a different --num-layers-per-virtual-pipeline-stage")
    for i, (chunk, key) in enumerate(zip(model, keys)):
        if len(model) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        try:
            chunk.load_state_dict(state_dict[key], strict=strict)
        except RuntimeError as e:
            raise CheckpointError(f"the model in {checkpoint_name} ['{key}'] does not fit this model: {e}") from e
    if len(model) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)


def _load_format(args, load_dir):
    """--ckpt-format, or with --auto-detect-ckpt-format the format the tracker's checkpoint directory holds."""
    if not getattr(args, "auto_detect_ckpt_format", False) or not _checkpoint_exists(load_dir):
        return args.ckpt_format
    try:
        _, _, iter_dir = _locate(load_dir, getattr(args, "ckpt_step", None))
    except CheckpointError:
        return args.ckpt_format
    detected = "torch_dist" if os.path.isfile(os.path.join(iter_dir, "metadata.json")) else \
        "torch" if _saved_layout(iter_dir) is not None else args.ckpt_format
    print_rank_0(f" --auto-detect-ckpt-format: {iter_dir} holds a {detected} checkpoint")
    return detected


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True):
    """Load ``--load`` (or ``--pretrained-checkpoint`` when ``--load`` has none) into model, optimizer, scheduler
    and RNG; set ``args.num_floating_point_operations_so_far``; return the iteration to resume from."""
    args = get_args()
    if _load_format(args, getattr(args, load_arg)) == "torch_dist":
        from megatron.training import dist_checkpointing
        return dist_checkpointing.load(model, optimizer, opt_param_scheduler, load_arg, strict)
    load_dir = getattr(args, load_arg)
    model = unwrap_model(model)
    finetune = bool(args.finetune)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if not _checkpoint_exists(load_dir) and pretrained is not None and getattr(args, "ckpt_step", None) is None:
        print_rank_0(f" no checkpoint in --load {load_dir}: loading --pretrained-checkpoint {pretrained} "
                     "(as with --finetune)")
        load_dir, finetune = pretrained, True
        if not _checkpoint_exists(load_dir):
            raise CheckpointError(f"--pretrained-checkpoint {load_dir} holds no checkpoint "
                                  f"({get_checkpoint_tracker_filename(load_dir)} does not exist)")
    if load_dir is None or (not _checkpoint_exists(load_dir) and getattr(args, "ckpt_step", None) is None):
        if args.exit_on_missing_checkpoint:
            print_rank_0(">> '--exit-on-missing-checkpoint' set ... exiting. <<")
            _barrier()
            sys.exit()
        print_rank_0("WARNING: could not find the metadata file {} ".format(
            get_checkpoint_tracker_filename(load_dir) if load_dir else None))
        print_rank_0("    will not load any checkpoints and will start from random")
        return 0

    ckpt_step = args.ckpt_step if load_dir == getattr(args, load_arg) else None  # not for --pretrained-checkpoint
    iteration, release, iter_dir = _locate(load_dir, ckpt_step)
    rank_file = get_checkpoint_name(load_dir, iteration, release)
    checkpoint_name = os.path.join(iter_dir, os.path.basename(os.path.dirname(rank_file)), MODEL_BASENAME)
    _check_layout(iter_dir, checkpoint_name)
    print_rank_0(" loading checkpoint from {} at iteration {}".format(load_dir, iteration))
    state_dict = _read_checkpoint_file(checkpoint_name)

    finetune = finetune or release
    if "args" in state_dict and not finetune:
        check_checkpoint_args(state_dict["args"], iter_dir)
        args.consumed_train_samples = getattr(state_dict["args"], "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(state_dict["args"], "consumed_valid_samples", 0)
    if finetune:
        iteration = 0
        args.num_floating_point_operations_so_far = 0
    else:
        iteration = state_dict.get("iteration", state_dict.get("total_iters", 0))
        args.num_floating_point_operations_so_far = state_dict.get("num_floating_point_operations_so_far", 0)

    _load_model(model, state_dict, checkpoint_name, strict)

    if not finetune and not args.no_load_optim:
        if optimizer is not None:
            if "optimizer" not in state_dict:
                raise CheckpointError(f"{checkpoint_name} holds no optimizer state (saved with --no-save-optim?); "
                                      "pass --no-load-optim or --finetune")
            optimizer.load_state_dict(state_dict["optimizer"])
        if args.use_distributed_optimizer and optimizer is not None:
            optim_name = get_distributed_optimizer_checkpoint_name(checkpoint_name)
            if not os.path.isfile(optim_name):
                raise CheckpointError(f"distributed optimizer state {optim_name} is missing; pass --no-load-optim "
                                      "to start the optimizer from scratch")
            state = _read_checkpoint_file(optim_name) if parallel_state.get_data_parallel_rank() == 0 else None
            optimizer.load_parameter_state(state)
        scheduler_state = state_dict.get("opt_param_scheduler", state_dict.get("lr_scheduler"))
        if opt_param_scheduler is not None and scheduler_state is not None:
            opt_param_scheduler.load_state_dict(scheduler_state)
    elif optimizer is not None and (args.fp16 or args.bf16):
        optimizer.reload_model_params()  # the fp32 main copies must follow the loaded weights

    if not finetune and not args.no_load_rng:
        if "rng_state" not in state_dict:
            raise CheckpointError(f"{checkpoint_name} holds no RNG state (saved with --no-save-rng?); pass "
                                  "--no-load-rng or --finetune")
        _set_rng_state(state_dict["rng_state"], args.data_parallel_random_init, checkpoint_name)

    _barrier()
    print_rank_0("  successfully loaded checkpoint from {} at iteration {}".format(load_dir, iteration))
    return iteration
