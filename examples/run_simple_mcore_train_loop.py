"""megatron-core's QuickStart, written for this library: the same calls as Megatron-LM's
``examples/run_simple_mcore_train_loop.py``, with the device lines for a CPU (gloo instead of nccl, CPU tensors, no
``set_device``).

    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py

Two ranks hold a GPT of 2 layers split by tensor parallelism (TP=2). The data are megatron-core's mock GPT dataset
with the ``null-text`` tokenizer; each of the 5 iterations runs ``get_forward_backward_func()`` (one micro-batch
of 8 sequences of 64 tokens) and ``finalize_model_grads``; then the model is saved with
``dist_checkpointing.save(model.sharded_state_dict(prefix=""), checkpoint_dir=...)`` into ``./ckpt`` and loaded
back with ``dist_checkpointing.load``. As with megatron-core's DistributedDataParallel, the gradients are reduced
into the ``main_grad`` buffers; the plain ``torch.optim.Adam`` of the QuickStart does not read them.
"""
import os
from functools import partial
from pathlib import Path

import torch
from torch.optim import Adam
from torch.utils.data import DataLoader

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.transformer.transformer_config import TransformerConfig

_SEQUENCE_LENGTH = 64
DEVICE = torch.device("cpu")  # the QuickStart's "cuda"


def initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    parallel_state.destroy_model_parallel()
    rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])  # the QuickStart counts the GPUs
    torch.distributed.init_process_group(backend="gloo", world_size=world_size, rank=rank)  # nccl there
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)


def model_provider():
    """Build the model."""
    transformer_config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32)
    gpt_model = GPTModel(config=transformer_config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=100, max_sequence_length=_SEQUENCE_LENGTH)
    return gpt_model


def get_train_data_iterator():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            compile_helpers()
        torch.distributed.barrier()
    else:
        compile_helpers()
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=_SEQUENCE_LENGTH, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=_SEQUENCE_LENGTH),
        mid_level_dataset_surplus=0.005)
    datasets = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config).build()
    train_dataloader = DataLoader(datasets[0], batch_size=8, shuffle=True)
    return iter(train_dataloader)


def forward_step_func(data_iterator, model):
    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        # If you have data parallel reduce loss across data parallel groups.
        # If pipeline parallel, loss computation is done only in last stage.
        return loss, {"lm loss": loss}

    data = next(data_iterator)
    tokens = data["tokens"].to(DEVICE)
    attention_mask = data["attention_mask"].to(DEVICE)
    position_ids = data["position_ids"].to(DEVICE)
    labels = data["labels"].to(DEVICE)
    loss_mask = data["loss_mask"].to(DEVICE)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def save_distributed_checkpoint(checkpoint_path, gpt_model):
    sharded_state_dict = gpt_model.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path)


def load_distributed_checkpoint(checkpoint_path, gpt_model):
    sharded_state_dict = gpt_model.sharded_state_dict(prefix="")
    checkpoint = dist_checkpointing.load(sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path)
    gpt_model.load_state_dict(checkpoint)
    return gpt_model


if __name__ == "__main__":
    initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)

    gpt_model = model_provider()
    gpt_model.to(DEVICE)

    config = gpt_model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    gpt_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt_model)

    optim = Adam(gpt_model.parameters())

    train_iterator = get_train_data_iterator()

    forward_backward_func = get_forward_backward_func()

    # Running the model for 5 iterations
    for _ in range(5):
        optim.zero_grad()

        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=train_iterator, model=gpt_model, num_microbatches=1,
            seq_length=_SEQUENCE_LENGTH, micro_batch_size=8, decoder_seq_length=_SEQUENCE_LENGTH, forward_only=False)

        # Finalize model grads: all-reduce over the data-parallel replicas (here there is one).
        finalize_model_grads([gpt_model])

        optim.step()

        print(f"Losses reduced :  {losses_reduced}")

    # Saving the model
    ckpt_path = os.getcwd() + "/ckpt"
    Path(ckpt_path).mkdir(exist_ok=True)
    save_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)

    # Loading the model
    gpt_model = load_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)
    gpt_model.to(DEVICE)
    print("Successfully loaded the model")
