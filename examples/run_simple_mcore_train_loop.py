"""Minimal megatron-core training loop: GPTModel with TP=2, PP=1, a plain torch optimizer, synthetic data.

    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py          # CPU (gloo) or GPUs (nccl)

Builds ``GPTModel`` from a ``TransformerConfig`` and ``get_gpt_layer_local_spec()`` exactly as research code does
with megatron-core, trains a few steps on a repeating token pattern and prints the losses (they should fall).
"""
import os

import torch
from torch.optim import Adam

from megatron.core import device, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

SEQUENCE_LENGTH = 64
VOCAB_SIZE = 100
MICRO_BATCH_SIZE = 4
TRAIN_STEPS = int(os.environ.get("TRAIN_STEPS", "10"))


def initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    parallel_state.destroy_model_parallel()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device.set_device_for_local_rank(int(os.environ.get("LOCAL_RANK", rank)))
    torch.distributed.init_process_group(backend=device.default_backend(), world_size=world_size, rank=rank)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)


def model_provider():
    """Build the model."""
    transformer_config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=2)
    return GPTModel(config=transformer_config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB_SIZE, max_sequence_length=SEQUENCE_LENGTH)


def get_batch(step):
    """Synthetic next-token data: each sample counts up from a random start (mod 32), an easy pattern."""
    generator = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, 32, (MICRO_BATCH_SIZE, 1), generator=generator)
    tokens = (starts + torch.arange(SEQUENCE_LENGTH + 1)) % 32
    dev = device.current_device()
    return {
        "tokens": tokens[:, :-1].to(dev),
        "labels": tokens[:, 1:].to(dev),
        "position_ids": torch.arange(SEQUENCE_LENGTH).unsqueeze(0).expand(MICRO_BATCH_SIZE, -1).to(dev),
        "attention_mask": torch.triu(torch.ones(1, 1, SEQUENCE_LENGTH, SEQUENCE_LENGTH, dtype=torch.bool), 1).to(dev),
        "loss_mask": torch.ones(MICRO_BATCH_SIZE, SEQUENCE_LENGTH, device=dev),
    }


def forward_step(batch, model):
    output_tensor = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    losses = output_tensor.float()
    loss_mask = batch["loss_mask"].view(-1).float()
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()


if __name__ == "__main__":
    initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)

    gpt_model = model_provider()
    gpt_model.to(device.current_device())
    optim = Adam(gpt_model.parameters(), lr=1e-2)

    for step in range(TRAIN_STEPS):
        optim.zero_grad()
        loss = forward_step(get_batch(step), gpt_model)
        loss.backward()
        optim.step()
        if torch.distributed.get_rank() == 0:
            print(f"Losses reduced :  step {step} loss {loss.item():.4f}", flush=True)

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
