"""validate_args: one-line ConfigurationErrors naming the flag, and derived values against hand-computed
numbers; core_transformer_config_from_args on a few flag sets; the entry-point error helper."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.args_test_helpers import BASE_ARGV, clean_env, parse, validated  # noqa: F401  (fixture)

from megatron.core import device
from megatron.training.arguments import core_transformer_config_from_args, validate_args
from megatron.training.errors import ConfigurationError, exit_on_configuration_error
from megatron.training.global_vars import get_current_global_batch_size, get_num_microbatches, set_global_variables

# (extra flags, world size, substring of the one-line message)
INVALID = [
    ("--tensor-model-parallel-size 3", 4, "--tensor-model-parallel-size (3) must divide the world size (4)"),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 3", 8,
     "world size (8) must be a multiple of --tensor-model-parallel-size (2) x --pipeline-model-parallel-size (3)"),
    ("--tensor-model-parallel-size 0", 1, "--tensor-model-parallel-size must be >= 1"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 2", 2,
     "--pipeline-model-parallel-split-rank (2) is outside the pipeline: the encoder takes stages [0, split) and the "
     "decoder [split, 2), so it must be in [1, 1] (--pipeline-model-parallel-size 2)"),
    ("--batch-size 4", 1, "--batch-size is no longer valid: use --micro-batch-size"),
    ("--warmup 10", 1, "--warmup is no longer valid: use --lr-warmup-fraction"),
    ("--model-parallel-size 2", 1, "--model-parallel-size is no longer valid: use --tensor-model-parallel-size"),
    ("--checkpoint-activations", 1, "--checkpoint-activations is no longer valid"),
    ("--micro-batch-size 0", 1, "--micro-batch-size must be > 0"),
    ("--micro-batch-size 4 --global-batch-size 10", 1,
     "--global-batch-size (10) must be a multiple of --micro-batch-size (4) x data-parallel size (1)"),
    ("--micro-batch-size 2 --global-batch-size 12", 4,
     "--global-batch-size (12) must be a multiple of --micro-batch-size (2) x data-parallel size (4)"),
    ("--rampup-batch-size 4 4 --global-batch-size 16", 1, "--rampup-batch-size expects 3 values"),
    ("--rampup-batch-size 4 4 100 --global-batch-size 18", 1,
     "--global-batch-size (18) minus the start batch size (4) must be a non-negative multiple of the increment (4)"),
    ("--rampup-batch-size 3 3 100 --global-batch-size 18", 1, "--rampup-batch-size start (3) and increment (3) must"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", 2,
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 2"),
    ("--pipeline-model-parallel-size 4 --num-layers 8 --num-layers-per-virtual-pipeline-stage 3", 4,
     "--num-layers (8) must be divisible by --num-layers-per-virtual-pipeline-stage (3)"),
    ("--fp16 --bf16", 1, "--fp16 and --bf16 cannot be used together"),
    ("--bf16 --DDP-impl torch", 1, "--bf16 (which accumulates gradients in fp32) needs --DDP-impl local"),
    ("--use-distributed-optimizer --no-contiguous-buffers-in-local-ddp", 1,
     "--use-distributed-optimizer needs contiguous gradient buffers: drop --no-contiguous-buffers-in-local-ddp"),
    ("--train-iters 10 --train-samples 100", 1, "--train-iters (iteration-based training) cannot be combined with "
                                                "--train-samples"),
    ("--train-iters 10 --lr-warmup-samples 5", 1, "cannot be combined with --lr-warmup-samples"),
    ("--train-samples 100 --lr-decay-iters 5", 1, "--train-samples (sample-based training) cannot be combined with "
                                                  "--lr-decay-iters"),
    ("--train-iters 10 --lr-warmup-fraction 0.1 --lr-warmup-iters 2", 1,
     "--lr-warmup-fraction and --lr-warmup-iters are exclusive"),
    ("--encoder-num-layers 4", 1, "--num-layers and --encoder-num-layers are exclusive"),
    ("--hidden-size 65", 1, "--hidden-size (65) must be divisible by --num-attention-heads (4)"),
    ("--tensor-model-parallel-size 8 --hidden-size 48 --num-attention-heads 4", 8,
     "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (8)"),
    ("--group-query-attention --num-query-groups 3", 1, "--num-attention-heads (4) must be divisible by "
                                                        "--num-query-groups (3)"),
    ("--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2", 2,
     "--num-query-groups (1) must be divisible by --tensor-model-parallel-size (2)"),
    ("--pipeline-model-parallel-size 2 --num-layers 5", 2, "--num-layers (5) must be divisible by the number of "
                                                           "transformer pipeline stages (2"),
    ("--seq-length 64", 1, "--max-position-embeddings (32) must be >= --seq-length (64)"),
    ("--decoder-seq-length 40", 1, "--max-position-embeddings (32) must be >= --decoder-seq-length (40)"),
    ("--lr 0.01 --min-lr 0.1", 1, "--min-lr (0.1) must be <= --lr (0.01)"),
    ("--save /tmp/ckpt", 1, "--save needs --save-interval"),
    ("--fp16-lm-cross-entropy", 1, "--fp16-lm-cross-entropy needs --fp16"),
    ("--fp32-residual-connection", 1, "--fp32-residual-connection needs --fp16 or --bf16"),
    ("--start-weight-decay 0.1 --end-weight-decay 0.2", 1, "--start-weight-decay/--end-weight-decay need "
                                                           "--weight-decay-incr-style linear or cosine"),
    ("--weight-decay-incr-style cosine --start-weight-decay 0.1", 1,
     "--weight-decay-incr-style cosine needs both --start-weight-decay and --end-weight-decay"),
    ("--distribute-saved-activations --recompute-granularity full --recompute-method uniform", 1,
     "--distribute-saved-activations needs --tensor-model-parallel-size > 1"),
    ("--recompute-activations --recompute-method block", 1, "--recompute-method is not supported with "
                                                            "--recompute-granularity selective"),
    ("--recompute-granularity full", 1, "--recompute-granularity full needs --recompute-method uniform or block"),
    ("--no-position-embedding", 1, "--no-position-embedding is deprecated: use --position-embedding-type rope"),
    ("--swiglu --openai-gelu", 1, "--openai-gelu and --swiglu each choose the MLP activation"),
    ("--seed 0", 1, "--seed must be a positive integer, got 0"),
    ("--retro-add-retriever", 1, "--retro-add-retriever: not available in this library: Retro"),
]


@pytest.mark.parametrize("extra,world_size,message", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_configuration(clean_env, extra, world_size, message):
    with pytest.raises(ConfigurationError) as exc:
        validated(extra, world_size=world_size)
    text = str(exc.value)
    assert message in text
    assert "\n" not in text and "--" in text  # one line that names a flag


def test_required_flags(clean_env):
    for flag, dest_message in (("--hidden-size", "--hidden-size is required"),
                               ("--micro-batch-size", "--micro-batch-size is required"),
                               ("--seq-length", "--seq-length (or --encoder-seq-length) is required"),
                               ("--num-layers", "--num-layers (or --encoder-num-layers) is required"),
                               ("--max-position-embeddings", "--max-position-embeddings is required")):
        i = BASE_ARGV.index(flag)
        base = BASE_ARGV[:i] + BASE_ARGV[i + 2:]
        with pytest.raises(ConfigurationError, match=fr"^{dest_message.replace('(', '[(]').replace(')', '[)]')}"):
            validated(base=base)
    assert issubclass(ConfigurationError, ValueError)


def test_cuda_device_max_connections_only_matters_on_cuda(clean_env, monkeypatch):
    extra = "--tensor-model-parallel-size 2 --sequence-parallel"
    validated(extra, world_size=2)  # CPU: nothing to set
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    with pytest.raises(ConfigurationError, match="--sequence-parallel requires the environment variable "
                                                 "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        validated(extra, world_size=2)
    with pytest.raises(ConfigurationError, match="pass --no-async-tensor-model-parallel-allreduce"):
        validated("", world_size=1)
    validated(extra + " --distributed-backend gloo", world_size=2)  # gloo keeps tensors on the CPU
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    validated(extra, world_size=2)


def test_parallel_sizes_and_batch_sizes(clean_env):
    args = validated("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", world_size=8)
    assert (args.data_parallel_size, args.transformer_pipeline_model_parallel_size) == (2, 2)
    assert args.global_batch_size == 2 * 2  # micro-batch 2 x dp 2
    args = validated("--tensor-model-parallel-size 16 --pipeline-model-parallel-size 4 --num-attention-heads 8",
                     world_size=8)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (8, 1, 1)
    args = validated("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4", world_size=4)
    assert (args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 1)
    args = validated("--pipeline-model-parallel-size 4 --standalone-embedding-stage --num-layers 6", world_size=4)
    assert args.transformer_pipeline_model_parallel_size == 3

    args = validated("--tensor-model-parallel-size 2 --global-batch-size 32", world_size=8)
    assert args.data_parallel_size == 4
    set_global_variables(args, build_tokenizer=False)
    assert get_num_microbatches() == 32 // (2 * 4) == 4
    assert get_current_global_batch_size() == 32


def test_model_shape_derivations(clean_env):
    args = validated()
    assert (args.ffn_hidden_size, args.kv_channels) == (256, 16)  # 4 x 64, 64 / 4
    assert validated("--swiglu").ffn_hidden_size == 128  # int(4*64*2/3 / 64) * 64 = int(2.67) * 64
    big = validated("--swiglu --hidden-size 4096 --num-attention-heads 32 --make-vocab-size-divisible-by 1")
    assert (big.ffn_hidden_size, big.kv_channels) == (10880, 128)  # int(10922.67 / 64) = 170 -> 170 * 64
    assert validated("--swiglu --ffn-hidden-size 100").ffn_hidden_size == 100
    assert validated("--kv-channels 8 --hidden-size 60").kv_channels == 8
    args = validated("--num-layers 2")
    assert (args.num_layers, args.encoder_num_layers) == (2, 2)
    args = parse()
    args.num_layers, args.encoder_num_layers = None, 3
    args = validate_args(args)
    assert args.num_layers == 3
    args = parse()
    args.seq_length, args.encoder_seq_length = None, 16
    assert validate_args(args).seq_length == 16


def test_virtual_pipeline_size(clean_env):
    args = validated("--pipeline-model-parallel-size 4 --num-layers 16 --num-layers-per-virtual-pipeline-stage 2",
                     world_size=4)
    assert args.virtual_pipeline_model_parallel_size == (16 // 4) // 2 == 2
    args = validated("--pipeline-model-parallel-size 4 --standalone-embedding-stage --num-layers 12 "
                     "--num-layers-per-virtual-pipeline-stage 2", world_size=4)
    assert args.virtual_pipeline_model_parallel_size == (12 // 3) // 2 == 2
    assert validated().virtual_pipeline_model_parallel_size is None


def test_precision_and_misc_derivations(clean_env, capsys):
    assert validated().params_dtype is torch.float32
    assert validated("--fp16").params_dtype is torch.float16
    args = validated("--bf16")
    assert args.params_dtype is torch.bfloat16 and args.accumulate_allreduce_grads_in_fp32 is True
    assert "accumulate and all-reduce gradients in fp32 for bfloat16 data type." in capsys.readouterr().out
    assert validated("--DDP-impl torch").use_contiguous_buffers_in_local_ddp is False

    args = validated("--recompute-activations --weight-decay 0.05 --disable-bias-linear --use-rotary-position-embeddings")
    assert args.recompute_granularity == "selective" and not hasattr(args, "recompute_activations")
    assert not any(hasattr(args, d) for d in ("batch_size", "warmup", "model_parallel_size", "checkpoint_activations"))
    assert (args.start_weight_decay, args.end_weight_decay) == (0.05, 0.05)
    assert args.bias_gelu_fusion is False and args.position_embedding_type == "rope"
    assert (args.dataloader_type, args.consumed_train_samples, args.consumed_valid_samples) == ("single", 0, 0)
    assert args.variable_seq_lengths is False

    assert validated("--sequence-parallel").sequence_parallel is False  # TP=1
    args = validated("--tensor-model-parallel-size 2 --sequence-parallel", world_size=2)
    assert args.sequence_parallel is True and args.async_tensor_model_parallel_allreduce is False


def test_padded_vocab(clean_env, capsys):
    assert validated("--vocab-size 50257").padded_vocab_size == 50304  # 393 x 128
    assert "padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)" in capsys.readouterr().out
    args = validated("--vocab-size 50257 --tensor-model-parallel-size 2", world_size=2)
    assert args.padded_vocab_size == 50432  # 197 x 256
    assert validated("--vocab-size 1000 --make-vocab-size-divisible-by 100").padded_vocab_size == 1000
    assert validated().padded_vocab_size is None  # --padded-vocab-size (None): set by the tokenizer later


def test_args_defaults_dict(clean_env, capsys):
    args = validated("--micro-batch-size 2", defaults={"micro_batch_size": 8, "tokenizer_type": "GPT2BPETokenizer",
                                                       "my_script_option": 5})
    assert (args.micro_batch_size, args.tokenizer_type, args.my_script_option) == (2, "GPT2BPETokenizer", 5)
    assert "WARNING: overriding default arguments for micro_batch_size:8 with micro_batch_size:2" in \
        capsys.readouterr().out


def test_core_transformer_config_from_args(clean_env):
    args = validated("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --bf16 --hidden-dropout 0.2 "
                     "--layernorm-epsilon 1e-6 --normalization RMSNorm --apply-layernorm-1p", world_size=4)
    cfg = core_transformer_config_from_args(args)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size, cfg.kv_channels) == \
        (4, 64, 4, 256, 16)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.bf16 and cfg.params_dtype is torch.bfloat16 and cfg.pipeline_dtype is torch.bfloat16
    assert cfg.hidden_dropout == 0.2 and cfg.layernorm_epsilon == 1e-6 and cfg.normalization == "RMSNorm"
    assert cfg.layernorm_zero_centered_gamma is True and cfg.persist_layer_norm is True
    # overlap_p2p_comm is on by default (today's Megatron-LM), so pipeline transfers are not batched
    assert cfg.deallocate_pipeline_outputs is True and cfg.batch_p2p_comm is False
    args = validated("--pipeline-model-parallel-size 2 --no-overlap-p2p-communication", world_size=2)
    assert core_transformer_config_from_args(args).batch_p2p_comm is True
    assert cfg.activation_func is F.gelu and cfg.gated_linear_unit is False and cfg.bias_gelu_fusion is True
    assert cfg.num_query_groups == 4  # no --group-query-attention: one group per head
    assert cfg.gradient_accumulation_fusion is True and cfg.masked_softmax_fusion is True

    cfg = core_transformer_config_from_args(validated(
        "--swiglu --group-query-attention --num-query-groups 2 --init-method-xavier-uniform --no-persist-layer-norm "
        "--overlap-p2p-communication --recompute-activations --disable-bias-linear"))
    assert cfg.activation_func is F.silu and cfg.gated_linear_unit is True and cfg.bias_gelu_fusion is False
    assert cfg.ffn_hidden_size == 128 and cfg.num_query_groups == 2 and cfg.add_bias_linear is False
    assert cfg.init_method is torch.nn.init.xavier_uniform_
    assert cfg.output_layer_init_method is torch.nn.init.xavier_uniform_
    assert cfg.persist_layer_norm is False and cfg.batch_p2p_comm is False
    assert cfg.recompute_granularity == "selective" and cfg.recompute_num_layers is None

    cfg = core_transformer_config_from_args(validated("--num-query-groups 2 --recompute-granularity full "
                                                      "--recompute-method uniform --recompute-num-layers 2"))
    assert cfg.num_query_groups == 4  # --num-query-groups alone does nothing
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 2)
    std = cfg.output_layer_init_method(torch.empty(20000)).std().item()
    assert abs(std - 0.02 / (2 * 4) ** 0.5) < 5e-4  # scaled init: std / sqrt(2 L)


def test_core_config_other_activations(clean_env):
    pytest.importorskip("megatron.core.transformer.fusions", reason="activations land with the models branch")
    x = torch.linspace(-3, 3, 101)
    cfg = core_transformer_config_from_args(validated("--openai-gelu"))
    tanh_gelu = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))
    assert torch.allclose(cfg.activation_func(x), tanh_gelu, atol=1e-6) and cfg.bias_gelu_fusion is False
    cfg = core_transformer_config_from_args(validated("--squared-relu"))
    assert torch.equal(cfg.activation_func(x), torch.clamp(x, min=0) ** 2) and cfg.gated_linear_unit is False


def test_exit_on_configuration_error(capsys):
    @exit_on_configuration_error()
    def main():
        raise ConfigurationError("--fp16 and --bf16\ncannot be used together")

    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: --fp16 and --bf16 cannot be used together\n"
    with pytest.raises(KeyError):  # other errors pass through untouched
        with exit_on_configuration_error():
            raise KeyError("x")


def test_entry_point_reports_one_line_and_exit_code_2(clean_env):
    """A real entry point with a bad flag: exit code 2, one stderr line, no traceback, no process group."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = root
    cmd = [sys.executable, os.path.join(root, "examples", "print_parallel_groups.py"), *BASE_ARGV,
           "--micro-batch-size", "4", "--global-batch-size", "10", "--distributed-backend", "gloo"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == ("error: --global-batch-size (10) must be a multiple of --micro-batch-size (4) x "
                           "data-parallel size (1)\n")
    assert "initializing torch distributed" not in proc.stdout
