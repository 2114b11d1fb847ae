"""Runs the REAL megatron-core 0.16.1 (never our package): builds the QuickStart's GPT (2 layers, hidden 12, 4 heads,
vocabulary 100, local spec) in one process at TP=1, loads the checkpoint directory given on the command line with
``megatron.core.dist_checkpointing.load`` and saves the model's state dict (tensors only) to the output file.

Usage (``PYTHONPATH=<megatron-core install dir>``, cwd outside our repository):
    python mcore_quickstart_oracle_child.py CKPT_DIR OUT.pt
Only this process stubs the few ``torch.cuda`` calls megatron-core makes on CPU.
"""
import os
import socket
import sys

import torch

from mcore_oracle_child import _stub_cuda


def main(ckpt, out):
    _stub_cuda()  # the interop child's stubs (this script's directory is on sys.path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(987)  # not the QuickStart's seed: the weights come from the file
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100,
                     max_sequence_length=64)
    state = dist_checkpointing.load(sharded_state_dict=model.sharded_state_dict(prefix=""), checkpoint_dir=ckpt)
    model.load_state_dict(state)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
