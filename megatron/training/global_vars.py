"""The training framework's process-wide singletons: args, tokenizer, timers, micro-batch calculator, ...

``set_global_variables(args)`` creates them once per process (``initialize_megatron`` calls it right after
``validate_args``); the getters return them. ``megatron.core`` never reads these: it is handed configs.
Tests reset everything with :func:`destroy_global_vars`.
"""
from __future__ import annotations

import os
import signal
import sys

from megatron.training.dist_signal_handler import DistributedSignalHandler
from megatron.training.errors import ConfigurationError
from megatron.core import num_microbatches_calculator
from megatron.training.microbatches import build_num_microbatches_calculator
from megatron.training.timers import Timers

_GLOBAL_ARGS = None
_GLOBAL_RETRO_ARGS = None
_GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_ADLR_AUTORESUME = None
_GLOBAL_TIMERS = None
_GLOBAL_SIGNAL_HANDLER = None


def _ensure_var_is_initialized(var, name, hint=""):
    assert var is not None, "{} is not initialized.{}".format(name, hint)


def _ensure_var_is_not_initialized(var, name):
    assert var is None, "{} is already initialized.".format(name)


# ----------------------------------------------------------------------------------------------- getters

def get_args():
    _ensure_var_is_initialized(_GLOBAL_ARGS, "args", " Call initialize_megatron() (or set_global_variables(args)) first.")
    return _GLOBAL_ARGS


def get_retro_args():
    """The retro preprocessing args (``--retro-add-retriever``), or None."""
    return _GLOBAL_RETRO_ARGS


def get_num_microbatches():
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get()


def get_current_global_batch_size():
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get_current_global_batch_size()


def update_num_microbatches(consumed_samples, consistency_check=True):
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR.update(consumed_samples, consistency_check)


def _install_calculator(calculator):
    """The training calculator is also megatron-core's process-wide one (megatron.core.num_microbatches_calculator
    answers the same numbers)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator
    num_microbatches_calculator.set_num_microbatches_calculator(calculator)


def get_tokenizer():
    _ensure_var_is_initialized(_GLOBAL_TOKENIZER, "tokenizer", " Pass --tokenizer-type (and its files).")
    return _GLOBAL_TOKENIZER


def get_tokenizer_or_none():
    """The tokenizer when one was built (``set_global_variables(build_tokenizer=True)``), else None."""
    return _GLOBAL_TOKENIZER


def get_tensorboard_writer():
    """The TensorBoard ``SummaryWriter`` (last rank, with --tensorboard-dir), or None."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_adlr_autoresume():
    """ADLR's AutoResume class (with --adlr-autoresume), or None."""
    return _GLOBAL_ADLR_AUTORESUME


def get_timers():
    _ensure_var_is_initialized(_GLOBAL_TIMERS, "timers")
    return _GLOBAL_TIMERS


def get_signal_handler():
    _ensure_var_is_initialized(_GLOBAL_SIGNAL_HANDLER, "signal handler", " Pass --exit-signal-handler.")
    return _GLOBAL_SIGNAL_HANDLER


# ----------------------------------------------------------------------------------------------- setters

def set_global_variables(args, build_tokenizer=True):
    """Create the args, micro-batch calculator, tokenizer, TensorBoard writer, autoresume, timers and
    (with --exit-signal-handler) signal handler singletons."""
    assert args is not None
    _ensure_var_is_not_initialized(_GLOBAL_ARGS, "args")
    set_args(args)

    _build_num_microbatches_calculator(args)
    # Entry points put --tokenizer-type in args_defaults; without one there is nothing to build and
    # get_tokenizer() says so when something asks for it.
    if build_tokenizer and getattr(args, "tokenizer_type", None) is not None:
        _build_tokenizer(args)
    _set_tensorboard_writer(args)
    _set_adlr_autoresume(args)
    _set_timers(args)
    if args.exit_signal_handler:
        _set_signal_handler(getattr(args, "exit_signal", 15))


def set_args(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


_set_args = set_args


def set_retro_args(retro_args):
    global _GLOBAL_RETRO_ARGS
    _GLOBAL_RETRO_ARGS = retro_args


def _build_num_microbatches_calculator(args):
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _ensure_var_is_not_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    _install_calculator(build_num_microbatches_calculator(args))


def _build_tokenizer(args):
    """Build the tokenizer (``megatron.tokenizer.build_tokenizer``; it also sets ``args.padded_vocab_size``)."""
    global _GLOBAL_TOKENIZER
    _ensure_var_is_not_initialized(_GLOBAL_TOKENIZER, "tokenizer")
    from megatron.tokenizer import build_tokenizer

    try:
        _GLOBAL_TOKENIZER = build_tokenizer(args)
    except (OSError, ValueError) as error:  # a missing, corrupt or mismatched tokenizer file, named in the message
        if isinstance(error, ConfigurationError):
            raise
        raise ConfigurationError(str(error)) from error
    return _GLOBAL_TOKENIZER


def rebuild_tokenizer(args):
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = None
    return _build_tokenizer(args)


def _set_tensorboard_writer(args):
    """A SummaryWriter on the last rank (where Megatron logs) when --tensorboard-dir is given."""
    global _GLOBAL_TENSORBOARD_WRITER
    _ensure_var_is_not_initialized(_GLOBAL_TENSORBOARD_WRITER, "tensorboard writer")
    if getattr(args, "tensorboard_dir", None) and args.rank == args.world_size - 1:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ModuleNotFoundError:
            print("WARNING: TensorBoard writing requested but is not available (install the tensorboard "
                  "package), no TensorBoard logs will be written.", flush=True)
            return
        print("> setting tensorboard ...", flush=True)
        _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)


def _set_adlr_autoresume(args):
    """ADLR's cluster autoresume hook (``userlib.auto_resume`` from $SUBMIT_SCRIPTS) with --adlr-autoresume."""
    global _GLOBAL_ADLR_AUTORESUME
    _ensure_var_is_not_initialized(_GLOBAL_ADLR_AUTORESUME, "adlr autoresume")
    if not args.adlr_autoresume:
        return
    if args.rank == 0:
        print("enabling autoresume ...", flush=True)
    sys.path.append(os.environ.get("SUBMIT_SCRIPTS", "."))
    try:
        from userlib.auto_resume import AutoResume
    except ImportError:
        raise ConfigurationError("--adlr-autoresume needs userlib.auto_resume (looked in $SUBMIT_SCRIPTS or the "
                                 "current directory): drop the flag or make the module importable") from None
    _GLOBAL_ADLR_AUTORESUME = AutoResume


def _set_timers(args):
    global _GLOBAL_TIMERS
    _ensure_var_is_not_initialized(_GLOBAL_TIMERS, "timers")
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)


def _set_signal_handler(sig=15):
    """--exit-signal-handler: catch --exit-signal (SIGTERM by default)."""
    global _GLOBAL_SIGNAL_HANDLER
    _ensure_var_is_not_initialized(_GLOBAL_SIGNAL_HANDLER, "signal handler")
    _GLOBAL_SIGNAL_HANDLER = DistributedSignalHandler(signal.Signals(sig)).__enter__()


def destroy_global_vars():
    """Forget every singleton (closing the TensorBoard writer and restoring the signal handler): for tests
    and for running several configurations in one process."""
    global _GLOBAL_ARGS, _GLOBAL_RETRO_ARGS, _GLOBAL_NUM_MICROBATCHES_CALCULATOR, _GLOBAL_TOKENIZER
    global _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_ADLR_AUTORESUME, _GLOBAL_TIMERS, _GLOBAL_SIGNAL_HANDLER
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
    if _GLOBAL_SIGNAL_HANDLER is not None:
        _GLOBAL_SIGNAL_HANDLER.release()
    _GLOBAL_ARGS = None
    _GLOBAL_RETRO_ARGS = None
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    num_microbatches_calculator.unset_num_microbatches_calculator()
    _GLOBAL_TOKENIZER = None
    _GLOBAL_TENSORBOARD_WRITER = None
    _GLOBAL_ADLR_AUTORESUME = None
    _GLOBAL_TIMERS = None
    _GLOBAL_SIGNAL_HANDLER = None
