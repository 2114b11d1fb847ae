"""Megatron-LM HEAD's model configurations (``examples/post_training/modelopt/conf/<org>/<model>.sh``, kept word for
word in tests/data/head_model_confs/ as ``<org>__<model>.sh``): their ``MODEL_ARGS`` as bash expands them, and a
shrunk form small enough to build and train on CPU."""
from __future__ import annotations

import functools
import os
import subprocess

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "head_model_confs")

# The families of the model-zoo issue and their configurations.
QWEN = ["Qwen__Qwen2.5-0.5B-Instruct", "Qwen__Qwen2.5-7B-Instruct", "Qwen__Qwen3-0.6B", "Qwen__Qwen3-8B",
        "Qwen__Qwen3-30B-A3B", "Qwen__Qwen3-235B-A22B"]
LLAMA3 = ["meta-llama__Llama-3.1-8B-Instruct", "meta-llama__Llama-3.2-1B-Instruct"]
GPT_OSS = ["openai__gpt-oss-20b", "openai__gpt-oss-120b"]
LLAMA4 = ["meta-llama__Llama-4-Scout-17B-16E-Instruct", "meta-llama__Llama-4-Maverick-17B-128E-Instruct"]


@functools.lru_cache(maxsize=None)
def model_args(name: str) -> tuple:
    """``MODEL_ARGS`` of configuration ``name`` split into words by bash itself (``$MODEL_ARGS`` unquoted, as the
    scripts that source these files pass it). The configurations' directory holds no file that a word such as
    ``([0,1]*24)`` could glob to."""
    path = os.path.join(CONF_DIR, name + ".sh")
    out = subprocess.run(["bash", "-c", 'source "$1" >/dev/null; printf "%s\\n" $MODEL_ARGS', "conf", path],
                         cwd=CONF_DIR, capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]})
    return tuple(out.stdout.split("\n")[:-1])


# Sizes of the shrunk models: flag -> value, applied only to flags the configuration sets.
SHRINK = {"--num-layers": "4", "--hidden-size": "32", "--ffn-hidden-size": "64", "--num-attention-heads": "4",
          "--num-query-groups": "2", "--kv-channels": "8", "--num-experts": "4", "--moe-ffn-hidden-size": "16",
          "--moe-shared-expert-intermediate-size": "24", "--seq-length": "16", "--max-position-embeddings": "64",
          "--moe-router-topk": "2"}


def shrunk(name: str, drop=("--bf16",), **sizes) -> list:
    """``MODEL_ARGS`` with the sizes of SHRINK (``sizes`` override them: ``num_layers=2``), every per-layer list
    (``--moe-layer-freq``) cut to the new layer count, and the flags of ``drop`` removed (their values too)."""
    table = dict(SHRINK, **{"--" + k.replace("_", "-"): str(v) for k, v in sizes.items()})
    argv = list(model_args(name))
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if flag in drop:
            i += 2 if takes_value else 1
            continue
        out.append(flag)
        if takes_value:
            value = argv[i + 1]
            out.append(table.get(flag, value))
            i += 2
        else:
            i += 1
    layers = int(table["--num-layers"])
    if "--moe-layer-freq" in out:
        at = out.index("--moe-layer-freq") + 1
        from megatron.training.arguments.model_args import layer_pattern

        freq = layer_pattern(out[at])
        if isinstance(freq, list):
            out[at] = str(freq[:layers]).replace(" ", "")
    if "--moe-router-topk" in out:  # top-1 configurations stay top-1
        at = out.index("--moe-router-topk") + 1
        if argv[argv.index("--moe-router-topk") + 1] == "1":
            out[at] = "1"
    return out


# Hybrid Mamba (Nemotron-H / Nemotron-Nano-v2 / Nemotron-3) and Nemotron-Mini (a GPT model).
NEMOTRON_H = ["nvidia__Nemotron-H-4B-Instruct", "nvidia__Nemotron-H-8B-Base-8K", "nvidia__Nemotron-H-47B-Reasoning-128K",
              "nvidia__Nemotron-H-56B-Base-8K", "nvidia__NVIDIA-Nemotron-Nano-9B-v2",
              "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "nvidia__NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
              "nvidia__NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16"]
NEMOTRON_MINI = ["nvidia__Nemotron-Mini-4B-Instruct"]
PATTERN_FLAGS = ("--hybrid-layer-pattern", "--hybrid-override-pattern")
MAMBA_SHRINK = {"--mamba-num-heads": "8", "--mamba-head-dim": "8", "--mamba-num-groups": "2", "--mamba-state-dim": "8"}


def shrunk_pattern(pattern: str) -> str:
    """One layer of each type of ``pattern``, in the order they first appear (``M-M*-...`` -> ``M-*``)."""
    return "".join(dict.fromkeys(pattern.replace("|", "")))


def shrunk_hybrid(name: str, drop=("--bf16",)) -> list:
    """:func:`shrunk` for a hybrid configuration: its pattern cut to one layer per type, the Mamba sizes of
    MAMBA_SHRINK (appended, overriding the configuration's), the MoE latent width 16."""
    out = shrunk(name, drop=drop)
    for flag in PATTERN_FLAGS + ("--moe-latent-size",):
        if flag in out:
            at = out.index(flag) + 1
            out[at] = "16" if flag == "--moe-latent-size" else shrunk_pattern(out[at])
    for flag, value in MAMBA_SHRINK.items():
        out += [flag, value]
    return out
