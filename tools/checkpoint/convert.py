#!/usr/bin/env python
"""Offline checkpoint conversion with Megatron's ``tools/checkpoint/convert.py`` interface (CPU only).

    python tools/checkpoint/convert.py --model-type GPT --loader legacy --saver legacy \\
        --load-dir ckpt_tp2_pp2 --save-dir ckpt_tp1_pp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 [--true-vocab-size 50257]

``torch_dist`` (Megatron-LM's distributed format, any source TP/PP) can be loader and saver too. Without
``--loader`` the format is detected from ``--load-dir`` (``detect_loader``).
``fsdp_dtensor`` (Megatron-FSDP) and ``torch_dcp`` (PyTorch FSDP2) convert to and from ``torch_dist`` (and each
other) with the whole training state: model (fp32 main weights), optimizer state and param groups, scheduler,
iteration and RNG (tools/checkpoint/fsdp_io.py), so training resumes in the other format with the same next losses.
``--model-type T5``: encoder and decoder stacks (legacy or megatron-core names), any source TP/PP/split rank; the
torch saver writes PP=1 (any TP), the torch_dist saver a checkpoint that loads with any TP/PP/split rank.
Loaders: ``legacy`` (aliases ``megatron``, ``core``, ``mcore``: Megatron ``torch``-format checkpoints with any
TP/PP, legacy or megatron-core model names) and ``hf`` (a Hugging Face directory of a family of the bridge table
``megatron.core.models.conversion.hf_registry``: GPT-2, Llama incl. Llama 3.x RoPE scaling, Mixtral, Qwen2-MoE,
Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE; the MoE models convert to and from ``torch_dist``, whose expert tensors load
under any EP/TP/PP). Savers:
``legacy`` (aliases as above; any target TP/PP) and ``hf`` (config.json + model.safetensors). Unlike Megatron
the loader and saver run in one process and exchange the full state dict directly (no queue). The written
torch checkpoints hold ``args``, ``checkpoint_version``, ``iteration`` and ``model`` (no optimizer or RNG state):
train from them with ``--finetune`` or ``--no-load-optim --no-load-rng``. BERT classifiers finetuned by tasks/
(``classification_head`` / ``multichoice_head``, legacy models) convert between torch-format layouts only.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

from tools.checkpoint.legacy_io import ConversionError, load_legacy, repad_vocab, save_legacy  # noqa: E402

_LEGACY_NAMES = ("legacy", "megatron", "core", "mcore")
# The formats whose whole training state converts (tools/checkpoint/fsdp_io.py).
_STATE_FORMATS = ("torch_dist", "fsdp_dtensor", "torch_dcp")
# The heads tasks/ puts on BERT (megatron.legacy.model Classification and MultipleChoice).
FINETUNED_HEADS = ("classification_head.", "multichoice_head.")


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="Megatron checkpoint converter (TP/PP resharding, Hugging Face "
                                                 "import/export)", allow_abbrev=False)
    parser.add_argument("--model-type", type=str, required=True, choices=["GPT", "BERT", "T5"],
                        help="Type of the model")
    parser.add_argument("--loader", type=str, default=None,
                        help="legacy (megatron, core, mcore: the torch format), torch_dist, fsdp_dtensor, torch_dcp "
                             "or hf; detected from --load-dir when not given")
    parser.add_argument("--saver", type=str, default="legacy",
                        help="legacy (megatron, core, mcore: the torch format), torch_dist, fsdp_dtensor, torch_dcp "
                             "or hf")
    parser.add_argument("--load-dir", type=str, required=True, help="Directory to load the model checkpoint from")
    parser.add_argument("--save-dir", type=str, required=True, help="Directory to save the model checkpoint to")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="Target tensor model parallel size (default: the source's)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="Target pipeline model parallel size (default: the source's)")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="Original size of the vocabulary: the padding is trimmed and redone for the target TP")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                        help="Vocabulary padding multiple (default: the source checkpoint's, else 128)")
    parser.add_argument("--megatron-path", type=str, default=None, help="Accepted for compatibility; unused")
    parser.add_argument("--max-queue-size", type=int, default=50, help="Accepted for compatibility; unused")
    parser.add_argument("--no-checking", action="store_true", help="Accepted for compatibility; unused")
    return parser.parse_args(argv)


def detect_loader(load_dir: str) -> str:
    """The loader for what ``load_dir`` holds (as --auto-detect-ckpt-format does for training): ``torch_dist`` (the
    tracker's checkpoint directory has metadata.json), ``legacy`` (a torch-format checkpoint), ``hf`` (config.json
    and no tracker file)."""
    from tools.checkpoint.dist_io import is_dist_checkpoint

    if is_dist_checkpoint(load_dir):
        return "torch_dist"
    if os.path.isfile(os.path.join(load_dir, "latest_checkpointed_iteration.txt")):
        from tools.checkpoint.fsdp_io import detect_dcp_format, iteration_dir

        found = detect_dcp_format(iteration_dir(load_dir))
        if found is not None:
            return found
    if os.path.isfile(os.path.join(load_dir, "latest_checkpointed_iteration.txt")):
        return "legacy"
    if os.path.isfile(os.path.join(load_dir, "config.json")):
        return "hf"
    raise ConversionError(f"--load-dir {load_dir} holds no checkpoint this converter reads (no "
                          "latest_checkpointed_iteration.txt, no Hugging Face config.json): check the path, or pass "
                          "--loader")


def convert(args):
    if args.loader is None:
        args.loader = detect_loader(args.load_dir)
        print(f"--loader not given: {args.load_dir} holds a {args.loader} checkpoint", flush=True)
    loader, saver = args.loader.lower(), args.saver.lower()
    if {loader, saver} & set(_STATE_FORMATS[1:]):
        return _convert_training_state(args, loader, saver)
    if loader not in _LEGACY_NAMES + ("hf", "torch_dist"):
        raise ConversionError(f"--loader {args.loader}: supported loaders are legacy (megatron, core, mcore), "
                              "torch_dist and hf")
    if saver not in _LEGACY_NAMES + ("hf", "torch_dist"):
        raise ConversionError(f"--saver {args.saver}: supported savers are legacy (megatron, core, mcore), "
                              "torch_dist and hf")
    if "hf" in (loader, saver) and args.model_type != "GPT":
        raise ConversionError("Hugging Face import/export supports --model-type GPT only (the decoder families of "
                              "megatron.core.models.conversion.hf_registry)")
    if loader == "hf" and saver == "hf":
        raise ConversionError("--loader hf --saver hf converts nothing; use a legacy saver or loader on one side")
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ConversionError("--save-dir must differ from --load-dir (the converter never overwrites its input)")

    if loader == "hf":
        from tools.checkpoint.hf_io import load_hf
        divisible = args.make_vocab_size_divisible_by or 128
        full, margs = load_hf(args.load_dir, divisible)
        info = {"iteration": 0, "release": True, "tp": 1, "pp": 1}
        true_vocab = args.true_vocab_size or margs.true_vocab_size
    else:
        if loader == "torch_dist":
            from tools.checkpoint.dist_io import load_dist
            full, margs, info = load_dist(args.load_dir)
        else:
            full, margs, info = load_legacy(args.load_dir)
        heads = sorted({k.split(".")[0] for k in full if k.startswith(FINETUNED_HEADS)})
        if heads:
            print(f"the checkpoint is a finetuned BERT classifier (tasks/: {', '.join(heads)}); its head is "
                  "replicated on every tensor-parallel rank and stored on the last pipeline stage", flush=True)
            if "torch_dist" in (loader, saver) or args.model_type != "BERT":
                raise ConversionError(f"{args.load_dir} holds a finetuned classifier ({', '.join(heads)}), a legacy "
                                      "model of tasks/: convert it with --model-type BERT --loader legacy --saver "
                                      "legacy (the torch format); torch_dist holds megatron-core models only")
        else:
            from tools.checkpoint.legacy_io import is_t5
            looks = "T5" if is_t5(full) else ("BERT" if "binary_head.weight" in full or "lm_head.bias" in full
                                              else "GPT")
            if looks != args.model_type:
                print(f"WARNING: --model-type {args.model_type} does not look like this checkpoint's model ({looks})",
                      flush=True)
        divisible = args.make_vocab_size_divisible_by or getattr(margs, "make_vocab_size_divisible_by", 128)
        true_vocab = args.true_vocab_size or getattr(margs, "true_vocab_size", None)
    print(f"loaded {args.load_dir}: {len(full)} tensors, TP={info['tp']} PP={info['pp']}, "
          f"iteration {'release' if info['release'] else info['iteration']}", flush=True)

    if getattr(margs, "hybrid_layer_pattern", None) and (saver in _LEGACY_NAMES or loader in _LEGACY_NAMES):
        raise ConversionError("hybrid (Mamba) checkpoints convert with --loader/--saver torch_dist or hf; the legacy "
                              "torch format has no hybrid layout")
    if getattr(margs, "num_experts", None) and (saver in _LEGACY_NAMES or loader in _LEGACY_NAMES):
        raise ConversionError("mixture-of-experts checkpoints convert with --loader/--saver torch_dist or hf (the "
                              "torch_dist format reshards experts over EP/TP/PP on load); legacy is not supported")
    if saver == "hf":
        from tools.checkpoint.hf_io import save_hf
        if args.target_tensor_parallel_size not in (None, 1) or args.target_pipeline_parallel_size not in (None, 1):
            raise ConversionError("--saver hf writes one unsharded model: leave the target TP/PP sizes at 1")
        save_hf(full, margs, args.save_dir, true_vocab)
        print(f"saved Hugging Face model to {args.save_dir}", flush=True)
        return
    tp = args.target_tensor_parallel_size or info["tp"]
    pp = args.target_pipeline_parallel_size or info["pp"]
    margs.padded_vocab_size = repad_vocab(full, true_vocab, divisible, tp)
    margs.make_vocab_size_divisible_by = divisible
    if true_vocab is not None:
        margs.true_vocab_size = true_vocab
    if saver == "torch_dist":
        from tools.checkpoint.dist_io import save_dist
        save_dist(full, margs, args.save_dir, tp, pp, info["iteration"], info["release"])
    else:
        save_legacy(full, margs, args.save_dir, tp, pp, info["iteration"], info["release"])
    print(f"saved TP={tp} PP={pp} checkpoint to {args.save_dir}", flush=True)


def _convert_training_state(args, loader, saver):
    """torch_dist <-> fsdp_dtensor <-> torch_dcp with the whole training state (tools/checkpoint/fsdp_io.py)."""
    from tools.checkpoint.fsdp_io import convert_state

    if loader not in _STATE_FORMATS or saver not in _STATE_FORMATS or loader == saver:
        raise ConversionError(f"--loader {loader} --saver {saver}: fsdp_dtensor and torch_dcp convert to and from "
                              f"{', '.join(f for f in _STATE_FORMATS if f not in (loader, saver))} only")
    if args.target_tensor_parallel_size not in (None, 1) or args.target_pipeline_parallel_size not in (None, 1):
        print("note: --target-tensor/pipeline-parallel-size are not needed: these formats load with any TP/PP "
              "(torch_dcp with 1)", flush=True)
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ConversionError("--save-dir must differ from --load-dir (the converter never overwrites its input)")
    state = convert_state(loader, saver, args.load_dir, args.save_dir)
    print(f"converted {args.load_dir} ({loader}) -> {args.save_dir} ({saver}): {len(state.model)} tensors, optimizer "
          f"state {sorted(state.optimizer) or 'none'}, iteration {state.common.get('iteration', 0)}", flush=True)


def main(argv=None):
    args = get_args(argv)
    try:
        convert(args)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
