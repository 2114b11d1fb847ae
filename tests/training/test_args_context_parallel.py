"""Bad context-parallel command lines stop in validate_args with one ConfigurationError line naming the flags,
before any process group exists; good ones derive Megatron's sizes (DP = world / (TP x PP x CP))."""
import pytest
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)

from megatron.training.errors import ConfigurationError


@pytest.mark.parametrize("extra,world,message", [
    # 32 tokens cut into 2 x 3 chunks
    ("--context-parallel-size 3", 6, "--seq-length (32) must be divisible by 2 x --context-parallel-size (6)"),
    ("--context-parallel-size 32", 32, "--seq-length (32) must be divisible by 2 x --context-parallel-size (64)"),
    # 36 tokens = 4 chunks of 9; the 18 local tokens of a CP rank do not split over 4 TP ranks (sequence parallel)
    ("--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel --seq-length 36 "
     "--max-position-embeddings 36", 8,
     "--seq-length (36) must be divisible by 2 x --context-parallel-size (4) and --seq-length / "
     "--context-parallel-size (18) by --tensor-model-parallel-size (4) with --sequence-parallel"),
    ("--context-parallel-size 2", 3, "world size (3) must be a multiple of --tensor-model-parallel-size (1) x "
                                     "--pipeline-model-parallel-size (1) x --context-parallel-size (2)"),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2", 6,
     "x --context-parallel-size (2): change a size or the number of processes"),
    ("--context-parallel-size 2 --use-legacy-models --ckpt-format torch", 2, "drop --use-legacy-models"),
    ("--context-parallel-size 2 --reset-attention-mask", 2, "supports causal attention only"),
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 1", 2,
     "--hierarchical-context-parallel-sizes: not available in this library"),
])
def test_bad_context_parallel_flags(clean_env, extra, world, message):
    with pytest.raises(ConfigurationError) as error:
        validated(extra, world_size=world)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_context_parallel_sizes(clean_env):
    args = validated("--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
                     "--cp-comm-type all_gather --global-batch-size 8", world_size=8)
    assert (args.data_parallel_size, args.context_parallel_size, args.tensor_model_parallel_size) == (2, 2, 2)
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    assert config.context_parallel_size == 2 and config.cp_comm_type == "all_gather"
    # Micro-batches per step depend on DP only: 8 / (micro-batch 2 x DP 2).
    from megatron.training.microbatches import build_num_microbatches_calculator

    assert build_num_microbatches_calculator(args).get() == 2
