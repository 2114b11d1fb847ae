"""The save protocol every checkpoint format follows, and the tracker both formats share.

::

    <save>/latest_checkpointed_iteration.txt     "<iteration>" or "release": the checkpoint to load
    <save>/iter_0000100/                        one complete checkpoint (its files depend on the format)
    <save>/iter_0000100.incomplete/             a save in progress (staging directory)
    <save>/iter_0000100.old/                    the previous copy of a re-saved iteration, until the new one is in

A save (a collective: every rank calls it) runs these steps; after each one every rank reports whether it failed
(:func:`agree_on_save_step`, an all-reduce that also synchronises like a barrier):

1. global rank 0 sweeps the debris of interrupted saves (``*.incomplete`` directories and tracker temporaries are
   removed; an ``.old`` copy whose replacement never arrived is renamed back) and creates the staging directory
   ``iter_0000100.incomplete`` (:func:`prepare_save_dir`);
2. every writing rank writes its files into the staging directory, each to a temporary name, fsync'ed, then
   renamed (:func:`atomic_write`), so a file is either absent or complete;
3. global rank 0 publishes (:func:`publish`): an existing ``iter_0000100`` is moved aside to ``iter_0000100.old``,
   the staging directory is renamed to ``iter_0000100`` (the directory is fsync'ed), and only then the tracker is
   rewritten (temporary name, fsync, rename); the ``.old`` copy is removed last.

What a process killed at each point leaves: before step 3's first rename, a ``.incomplete`` directory that no
tracker names (swept by the next save; the tracker still names the previous complete checkpoint); between moving
the old copy aside and renaming the staging directory, ``iter_0000100.old`` only (the loader falls back to it, the
next save renames it back); after the directory rename but before the tracker rename, a complete new directory
the tracker does not name yet (the previous checkpoint is loaded); after the tracker rename, the new checkpoint.

Failures agree across ranks: a rank whose disk is full does not leave the others waiting in a barrier. Every rank
raises the same one-line :class:`CheckpointError` naming the checkpoint directory, the failing rank and the cause
("no space left on device ..."); global rank 0 removes the staging directory and the tracker is left as it was.

:func:`save_stage` is called at each step of a save by every format, looked up on this module at call time, so a
test that replaces ``protocol.save_stage`` intercepts every format's saves.
"""
from __future__ import annotations

import errno
import os
import shutil

import torch

from megatron.core import device
from megatron.training.errors import FatalRunError
from megatron.training.global_vars import get_args
from megatron.training.utils import is_rank_0

TRACKER_BASENAME = "latest_checkpointed_iteration.txt"
STAGING_SUFFIX = ".incomplete"
ASIDE_SUFFIX = ".old"
_CHECKED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                 "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type")


class CheckpointError(FatalRunError):
    """A checkpoint that cannot be read or does not match the run; the message names the file."""


def save_stage(stage: str, path: str) -> None:
    """Called at each step of a save (stage names: 'file-temp-written', 'file-renamed', 'all-files-written',
    'previous-copy-moved-aside', 'iteration-dir-renamed', 'tracker-temp-written', 'tracker-renamed').
    A no-op; tests replace it to kill the process in the middle of a save."""


# ------------------------------------------------------------------------------------------- names

def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, TRACKER_BASENAME)


def iteration_dirname(iteration, release=False):
    return "release" if release else "iter_{:07d}".format(iteration)


# ------------------------------------------------------------------------------------ atomic files

def fsync_dir(path):
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


def atomic_write(path, mode, write, stage):
    """Write to a temporary name, fsync, rename: ``path`` is either absent or complete.

    ``stage`` ("file" or "tracker") names the :func:`save_stage` hooks passed on the way.
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
    save_stage(f"{stage}-temp-written", tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
    save_stage(f"{stage}-renamed", path)


def atomic_torch_save(obj, path):
    atomic_write(path, "wb", lambda f: torch.save(obj, f), "file")


def atomic_write_bytes(path, data: bytes):
    atomic_write(path, "wb", lambda f: f.write(data), "file")


def atomic_write_text(path, text):
    atomic_write(path, "w", lambda f: f.write(text), "tracker")


# ------------------------------------------------------------------------------------------ tracker

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


def checkpoint_exists(load_dir):
    return load_dir is not None and os.path.isfile(get_checkpoint_tracker_filename(load_dir))


def locate(load_dir, ckpt_step, read_tracker=read_metadata):
    """(iteration, release, iteration directory) of the checkpoint to load from ``load_dir``."""
    if ckpt_step is not None:
        iteration, release = ckpt_step, False
    else:
        iteration, release = read_tracker(get_checkpoint_tracker_filename(load_dir))
    iter_dir = os.path.join(load_dir, iteration_dirname(iteration, release))
    if not os.path.isdir(iter_dir) and os.path.isdir(iter_dir + ASIDE_SUFFIX):
        iter_dir += ASIDE_SUFFIX  # a re-save of this iteration was interrupted between its two renames
    if not os.path.isdir(iter_dir):
        source = f"--ckpt-step {ckpt_step}" if ckpt_step is not None else get_checkpoint_tracker_filename(load_dir)
        raise CheckpointError(f"checkpoint directory {iter_dir} (named by {source}) does not exist")
    return iteration, release, iter_dir


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


# ------------------------------------------------------------------------------------ save steps

def barrier():
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


def run_step(step):
    """Run ``step()``; return the exception it raised (None when it succeeded)."""
    try:
        step()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - reported to every rank by agree_on_save_step (DCP's
        return e                # CheckpointException is a BaseException)
    return None


def prepare_save_dir(save_dir, iteration):
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
    final = os.path.join(save_dir, iteration_dirname(iteration))
    staging = final + STAGING_SUFFIX
    os.makedirs(staging, exist_ok=True)
    return final, staging


def publish(save_dir, final, staging, iteration):
    """Rank 0, after every rank has written its files: move the staging directory into place, then point the
    tracker at it. An existing copy of the same iteration stays on disk (as ``.old``) until both are done."""
    aside = final + ASIDE_SUFFIX
    if os.path.isdir(final):
        os.replace(final, aside)
        save_stage("previous-copy-moved-aside", aside)
    os.replace(staging, final)
    fsync_dir(save_dir)
    save_stage("iteration-dir-renamed", final)
    atomic_write_text(get_checkpoint_tracker_filename(save_dir), str(iteration))
    if os.path.isdir(aside):
        shutil.rmtree(aside)


def write_staged(save_dir, iteration, write, group=None):
    """Collective: one save by the protocol of the module docstring. ``write(staging)`` runs on every rank (it
    writes this rank's files into the staging directory); the ranks agree after each step, so a failure on one rank
    raises the same CheckpointError on all of them and leaves the previous checkpoint and the tracker as they were.
    Returns the published directory."""
    rank0 = torch.distributed.get_rank() == 0
    final = os.path.join(save_dir, iteration_dirname(iteration))
    staging = final + STAGING_SUFFIX

    def agree(error):
        agree_on_save_step(error, save_dir, iteration, group=group,
                           on_failure=lambda: shutil.rmtree(staging, ignore_errors=True))

    agree(run_step(lambda: prepare_save_dir(save_dir, iteration)) if rank0 else None)
    agree(run_step(lambda: write(staging)))
    error = None
    if rank0:
        def finish():
            save_stage("all-files-written", staging)
            publish(save_dir, final, staging, iteration)
        error = run_step(finish)
    agree(error)
    return final
