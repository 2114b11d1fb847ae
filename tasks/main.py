"""Megatron-LM's downstream-task entry point: ``python tasks/main.py --task <TASK> <Megatron flags>``.

Tasks: ``WIKITEXT103`` (perplexity) and ``LAMBADA`` (accuracy) evaluate a GPT checkpoint (``--load``) zero-shot;
``MNLI``, ``QQP`` (GLUE TSV files) and ``RACE`` (directories of JSON lines) finetune a BERT checkpoint
(``--pretrained-checkpoint``). The task flags are Megatron's (``get_tasks_args``). Before any process group exists
the task, its flags and every data file's rows are checked (``validate_task_args``): a mistake stops with one
``error:`` line naming the flag, file and line.

Checkpoints: the format of ``--load`` / ``--pretrained-checkpoint`` is read from the directory
(``--auto-detect-ckpt-format`` is on for the tasks), so the ``torch_dist`` checkpoints ``pretrain_gpt.py`` writes by
default, and 2023 ``torch`` ones, load as they are. ``--ckpt-format`` (the format of saves) defaults to what the
task's model writes: ``torch_dist`` for the zero-shot GPT tasks, as in ``pretrain_gpt.py``; ``torch`` for the finetuned
classifiers and ``--use-legacy-models`` GPTs (legacy models, which read and write only that format: a ``torch_dist``
BERT is converted first with ``tools/checkpoint/convert.py``, the error says how).
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training.errors import ConfigurationError, exit_on_configuration_error  # noqa: E402

ZEROSHOT_TASKS = ("LAMBADA", "WIKITEXT103")
GLUE_TASKS = ("MNLI", "QQP")
FINETUNE_TASKS = GLUE_TASKS + ("RACE",)
# Megatron's ORQA tasks (retriever evaluation and finetuning) need FAISS and the DPR data; not implemented here.
ORQA_TASKS = ("ICT-ZEROSHOT-NQ", "RETRIEVER-EVAL", "RET-FINETUNE-NQ")


def get_tasks_args(parser):
    """Megatron's task flags. ``--pretrained-checkpoint`` is one of the core checkpointing flags already."""
    group = parser.add_argument_group(title="tasks")
    group.add_argument("--task", type=str, required=True, help="Task name.")
    group.add_argument("--epochs", type=int, default=None,
                       help="Number of finetuning epochs. Zero results in evaluation only.")
    group.add_argument("--keep-last", action="store_true",
                       help="Keep the last batch (maybe incomplete) in the data loader")
    group.add_argument("--train-data", nargs="+", default=None,
                       help="Whitespace separated paths or corpora names for training.")
    group.add_argument("--valid-data", nargs="*", default=None, help="path(s) to the validation data.")
    group.add_argument("--overlapping-eval", type=int, default=32,
                       help="Sliding window for overlapping evaluation.")
    group.add_argument("--strict-lambada", action="store_true",
                       help="Use more difficult formulation of lambada.")
    # Retriever args
    group.add_argument("--qa-data-dev", type=str, default=None, help="Path to the QA dataset dev file.")
    group.add_argument("--qa-data-test", type=str, default=None, help="Path to the QA dataset test file.")
    # Faiss arguments for retriever
    group.add_argument("--faiss-use-gpu", action="store_true", help="Whether create the FaissMIPSIndex on GPU")
    group.add_argument("--faiss-match", type=str, default="string", choices=["regex", "string"],
                       help="Answer matching logic type")
    group.add_argument("--faiss-topk-retrievals", type=int, default=100, help="Number of blocks to use as top-k "
                                                                              "during retrieval")
    # finetune for retriever (--eval-micro-batch-size is one of Megatron's own options now)
    group.add_argument("--train-with-neg", action="store_true",
                       help="Whether to use negative examples during model training")
    group.add_argument("--train-hard-neg", type=int, default=0,
                       help="Number of hard negative exmaples to use during training")
    # parameters for Av.rank validation method
    group.add_argument("--val-av-rank-hard-neg", type=int, default=30,
                       help="Av.rank validation: how many hard negatives to take from each question pool")
    group.add_argument("--val-av-rank-other-neg", type=int, default=30,
                       help="Av.rank validation: how many other negatives to take from each question pool")
    # Loads detect the format; --ckpt-format is left unset here and defaults to the task model's (task_ckpt_format).
    parser.set_defaults(auto_detect_ckpt_format=True, ckpt_format=None)
    return parser


def task_ckpt_format(args) -> str:
    """The format the task's model saves by default: ``torch`` for the legacy models (the finetuned classifiers,
    ``--use-legacy-models``), ``torch_dist`` otherwise (pretrain_gpt.py's default)."""
    return "torch" if args.task in FINETUNE_TASKS or args.use_legacy_models else "torch_dist"


def _check_files(flag, paths, check):
    for path in paths:
        if not os.path.exists(path):
            raise ConfigurationError(f"{flag} {path}: no such file or directory")
        try:
            check(path)
        except ConfigurationError as e:
            raise ConfigurationError(f"{flag}: {e}") from e


def validate_task_args(args) -> None:
    """The task flags and the rows of every data file, before any process group (one-line ConfigurationError)."""
    task = args.task
    if task in ORQA_TASKS:
        raise ConfigurationError(f"--task {task}: Megatron's ORQA retriever tasks are not implemented in this "
                                 f"library; the tasks are {', '.join(ZEROSHOT_TASKS + FINETUNE_TASKS)}")
    if task not in ZEROSHOT_TASKS + FINETUNE_TASKS:
        raise ConfigurationError(f"--task {task}: Task {task} is not implemented; choose one of "
                                 f"{', '.join(ZEROSHOT_TASKS + FINETUNE_TASKS)}")
    if args.num_layers_per_virtual_pipeline_stage is not None or \
            getattr(args, "virtual_pipeline_model_parallel_size", None) is not None:
        raise ConfigurationError("--num-layers-per-virtual-pipeline-stage: the interleaved pipeline schedule is not "
                                 "supported for downstream tasks; drop it")
    if task in ZEROSHOT_TASKS:
        _validate_zeroshot(args)
    else:
        _validate_finetune(args)


def _validate_zeroshot(args):
    from tasks.zeroshot_gpt.datasets import read_lambada
    from tasks.zeroshot_gpt.detokenizer import get_detokenizer

    if not args.valid_data or len(args.valid_data) != 1:
        raise ConfigurationError(f"--valid-data: --task {args.task} evaluates one file; pass its path "
                                 f"(got {len(args.valid_data or [])})")
    if args.task == "LAMBADA":
        _check_files("--valid-data", args.valid_data, read_lambada)
    else:
        _check_files("--valid-data", args.valid_data, lambda path: None)
        if get_detokenizer(args.valid_data[0]) is None:
            raise ConfigurationError(f"--valid-data {args.valid_data[0]}: the WIKITEXT103 detokenizer is chosen by "
                                     "the file name, which must contain 'wiki', 'ptb' or 'lambada'")
    if args.overlapping_eval < 1 or (args.seq_length is not None and args.overlapping_eval > args.seq_length):
        raise ConfigurationError(f"--overlapping-eval {args.overlapping_eval} must be between 1 and --seq-length "
                                 f"({args.seq_length})")


def _holds_torch_dist(path) -> bool:
    """Whether the checkpoint the tracker of ``path`` names is a torch_dist one (its directory has metadata.json)."""
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    try:
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else "iter_{:07d}".format(int(text))
    except (OSError, ValueError):
        return False
    return os.path.isfile(os.path.join(path, name, "metadata.json"))


def _validate_finetune(args):
    if args.epochs is None or args.epochs < 0:
        raise ConfigurationError(f"--epochs: --task {args.task} finetunes for --epochs N epochs (0: evaluate only); "
                                 f"got {args.epochs}")
    if args.ckpt_format not in (None, "torch"):
        raise ConfigurationError(f"--ckpt-format {args.ckpt_format}: the {args.task} classifier is a legacy model "
                                 "(megatron.legacy.model); use --ckpt-format torch")
    for flag, path in (("--pretrained-checkpoint", args.pretrained_checkpoint), ("--load", args.load)):
        if path is not None and _holds_torch_dist(path):
            raise ConfigurationError(
                f"{flag} {path} is a torch_dist checkpoint; the {args.task} classifier (a legacy model) loads the "
                f"torch format: convert it with python tools/checkpoint/convert.py --model-type BERT --loader "
                f"torch_dist --saver legacy --load-dir {path} --save-dir {path.rstrip('/')}_torch")
    if args.rampup_batch_size is not None:
        raise ConfigurationError("--rampup-batch-size: batch size scaling is not supported for finetuning")
    if args.seq_length is None:
        raise ConfigurationError(f"--seq-length: --task {args.task} needs the sequence length of its samples")
    if args.epochs > 0 and not args.train_data:
        raise ConfigurationError(f"--train-data: --task {args.task} with --epochs {args.epochs} needs training files")
    if not args.valid_data:
        raise ConfigurationError(f"--valid-data: --task {args.task} needs validation files (accuracy is measured on "
                                 "each)")
    if args.task == "RACE":
        from tasks.race.data import read_race_dir
        check = read_race_dir
    else:
        from tasks.glue.data import read_tsv
        from tasks.glue.finetune import glue_task

        _, dataset_class = glue_task(args.task)

        def check(path):
            if os.path.isdir(path):
                raise ConfigurationError(f"{path} is a directory; --task {args.task} reads TSV files")
            dataset_class.process_rows(path, read_tsv(path))
    if args.epochs > 0:
        _check_files("--train-data", args.train_data, check)
    _check_files("--valid-data", args.valid_data, check)


def initialize_task(argv=None) -> None:
    """Parse and check the task flags (before any process group), then ``initialize_megatron`` with them."""
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron

    args = parse_args(get_tasks_args, argv=argv)
    validate_task_args(args)
    initialize_megatron(extra_args_provider=get_tasks_args, args_defaults={"ckpt_format": task_ckpt_format(args)},
                        argv=argv)


def main(argv=None):
    """Parse and check the flags, initialise Megatron, run the task."""
    with exit_on_configuration_error():
        initialize_task(argv)
    from megatron.training.global_vars import get_args

    task = get_args().task
    if task in GLUE_TASKS:
        from tasks.glue.finetune import main as task_main
    elif task == "RACE":
        from tasks.race.finetune import main as task_main
    else:
        from tasks.zeroshot_gpt.evaluate import main as task_main
    with exit_on_configuration_error():
        task_main()


if __name__ == "__main__":
    main()
