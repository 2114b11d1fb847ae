"""What the parameters, gradients and optimizer state of one rank occupy, measured on the live objects.

``resident_state_bytes(model_chunks, optimizer)`` counts the bytes of every storage (once, however many tensors
view it) that the data-parallel wrapper and the optimizer hold between micro-batches, in three classes:

* ``weights``: the model weights the modules compute with: our DDP's parameters (or its parameter buffer), the
  gathered whole weights an FSDP2 unit keeps (``optim_grads``); none for ``optim_grads_params`` at rest;
* ``grads``: our DDP's gradient buffers (``main_grad``), or the sharded ``.grad`` of FSDP2 parameters (the local
  blocks, with FSDP2's padding);
* ``optimizer``: the optimizer's state tensors (Adam's moments) and the main weights it updates when they are not
  the model weights (fp32 copies of 16-bit parameters, the distributed optimizer's shards, FSDP2's sharded fp32
  parameters).

The sizes are storage sizes, so padding (bucket padding to a multiple of DP, FSDP2's ``ceil(rows / d)`` blocks) is
included. Activations and the transient buffers of one unit's all-gather / reduce-scatter are not.
megatron/training/theoretical_memory.py gives the same three numbers from the configuration alone.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def resident_state_bytes(model_chunks: List[torch.nn.Module], optimizer) -> Dict[str, int]:
    out = {"weights": 0, "grads": 0, "optimizer": 0}
    seen = set()

    def add(kind: str, tensors: Iterable):
        for tensor in tensors:
            if tensor is None or not torch.is_tensor(tensor):
                continue
            storage = _local(tensor).untyped_storage()
            key = storage._cdata  # the storage itself: on the meta device (device.build_on) every data_ptr is 0
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            out[kind] += storage.nbytes()

    for chunk in model_chunks:
        if getattr(chunk, "uses_fully_shard", False):
            sharded = {id(p) for p in chunk.parameters()}
            add("weights", (p for p in chunk.module.parameters() if id(p) not in sharded))  # gathered copies
            add("grads", (p.grad for p in chunk.parameters()))
        else:
            add("weights", chunk.parameters())
            buffers = getattr(chunk, "param_and_grad_buffers", [])
            add("grads", (b.grad_data for b in buffers))
            add("grads", (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                          for p in chunk.parameters()))
    if optimizer is not None:
        add("optimizer", optimizer.get_parameters())
        add("optimizer", (p.grad for p in optimizer.get_parameters()))  # fp32 copies of 16-bit gradients (fp16)
        add("optimizer", (value for state in optimizer.optimizer.state.values() for key, value in state.items()
                          if key != "step"))
    return out
