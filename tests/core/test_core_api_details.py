"""megatron-core API details Megatron's own code relies on: the mappings' ``symbolic``, VocabUtility tuples,
TransformerBlock attributes, and the initialize_model_parallel assertion."""
import inspect
import subprocess
import sys

import pytest
import torch

from helpers.models_helpers import single_rank, tiny_config  # noqa: F401  (fixture)

from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.utils import VocabUtility

SEVEN = ("_CopyToModelParallelRegion", "_ReduceFromModelParallelRegion", "_ScatterToModelParallelRegion",
         "_GatherFromModelParallelRegion", "_ScatterToSequenceParallelRegion", "_GatherFromSequenceParallelRegion",
         "_ReduceScatterToSequenceParallelRegion")


@pytest.mark.parametrize("name", SEVEN)
def test_mapping_has_symbolic_equal_to_forward(single_rank, name):
    cls = getattr(mappings, name)
    assert isinstance(inspect.getattr_static(cls, "symbolic"), staticmethod)
    x = torch.randn(4, 3)
    # TP = 1: every mapping is the identity; symbolic(graph, x) records the forward computation.
    assert torch.equal(cls.symbolic(None, x), x)
    assert list(inspect.signature(cls.symbolic).parameters)[:2] == ["graph", "input_"]


def test_vocab_utility_returns_tuples():
    assert VocabUtility.vocab_range_from_global_vocab_size(1024, 2, 4) == (512, 768)
    r = VocabUtility.vocab_range_from_per_partition_vocab_size(100, 3, 4)
    assert isinstance(r, tuple) and r == (300, 400)


def test_transformer_block_attributes(single_rank):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerBlock

    block = TransformerBlock(tiny_config(num_layers=3), get_gpt_layer_local_spec())
    assert block.num_layers_per_pipeline_rank == 3 and block.checkpoint_core_attention is False
    block = TransformerBlock(tiny_config(num_layers=2, recompute_granularity="selective"), get_gpt_layer_local_spec())
    assert block.checkpoint_core_attention is True


def test_initialize_model_parallel_before_init_process_group_asserts():
    code = ("from megatron.core import parallel_state\n"
            "try:\n    parallel_state.initialize_model_parallel(1, 1)\n"
            "except AssertionError as e:\n    print('ASSERT', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ASSERT initialize_model_parallel needs torch.distributed.init_process_group" in out.stdout, out.stderr
