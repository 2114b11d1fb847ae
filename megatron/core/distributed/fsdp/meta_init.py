"""``--init-model-with-meta-device``: build the model on the meta device, then draw its weights unit by unit, each
rank keeping only its shard, with the values of the ordinary initialisation.

Building a model draws every weight from the random generators in a fixed order (the order in which the layers'
constructors run). With ``config.init_model_with_meta_device`` the layers create their parameters on the meta device
(``param_device``) and their ``reset_parameters()`` draws nothing on meta parameters (``weights_on_meta``): no
storage, no generator advances; buffers and other tensors are built as usual. Materialising replays the draws: the
generators are set back to the states they had when the build started (:class:`RngStates`), then,
in the constructors' order, every *owner* redraws its weights into freshly allocated tensors of the dtype and
device the build would have used, and each parameter keeps the part this rank holds:

* a DTensor parameter of FSDP2 (ZeRO-2/3, ``--use-torch-fsdp2``) keeps its ``torch.chunk`` row block (the fresh
  whole tensor is freed when the owner is done), so the largest allocation is one owner's weights, never the model;
* a plain meta parameter (the bucketed ZeRO-1 strategy, which holds whole weights anyway) takes the whole tensor.

An *owner* is a module with ``reset_parameters()`` that no ancestor with one encloses (a linear layer, a norm, the
embedding, a router, an expert group, a Mamba mixer ...). Its ``reset_parameters()`` redraws every parameter of its
subtree exactly as the constructors drew them (the layers of this library are written that way: each constructor
creates empty parameters and calls its own ``reset_parameters()``). Owners are visited in module pre-order, which is
the construction order of this library's models; the generators therefore advance exactly as in the ordinary build
and every weight, and the generator states afterwards (dropout), are bitwise those of a run without the flag.
A parameter no owner covers stops the run with a message naming its module (Megatron-FSDP's rule too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from megatron.core import device as _device
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

FLAG = "--init-model-with-meta-device"


class MetaInitError(RuntimeError):
    """The model cannot be materialised from the meta device (the message names the module)."""


@dataclass
class RngStates:
    """The generators a model build draws from: torch's CPU generator, the accelerator's, the TP-rank tracker's."""

    cpu: torch.Tensor
    accelerator: torch.Tensor
    tracker: dict

    @classmethod
    def capture(cls) -> "RngStates":
        return cls(torch.get_rng_state(), _device.get_rng_state(), get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        _device.set_rng_state(self.accelerator)  # the CPU generator again when there is no accelerator
        get_cuda_rng_tracker().set_states(dict(self.tracker))


def _owners(root: torch.nn.Module) -> List[torch.nn.Module]:
    """The outermost modules with ``reset_parameters`` (pre-order)."""
    owners, inside = [], set()
    for module in root.modules():
        if id(module) in inside or not hasattr(module, "reset_parameters"):
            continue
        owners.append(module)
        inside.update(id(m) for m in module.modules())
    return owners


def _check_covered(root: torch.nn.Module, owners: List[torch.nn.Module]) -> None:
    covered = {id(m) for o in owners for m in o.modules()}
    for name, module in root.named_modules():
        if id(module) not in covered and any(p is not None for p in module._parameters.values()):
            raise MetaInitError(f"{FLAG}: {type(module).__name__} ({name or 'the model'}) has parameters but no "
                                "reset_parameters() to draw them: drop " + FLAG)


def _place(param: torch.nn.Parameter, full: torch.Tensor, on: torch.device) -> None:
    """Keep this rank's part of ``full``: a DTensor's ``torch.chunk`` row block, or the whole tensor."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = param.to_local()
            mesh = param.device_mesh
            shard_dim = mesh.ndim - 1  # FSDP2 shards over the last mesh dimension (replicates over any other)
            blocks = torch.chunk(full, mesh.shape[shard_dim], dim=0)
            rank = mesh.get_local_rank(shard_dim)
            block = blocks[rank] if rank < len(blocks) else full[:0]
            if tuple(block.shape) != tuple(local.shape):
                raise MetaInitError(f"{FLAG}: a shard of {tuple(local.shape)} where torch.chunk gives "
                                    f"{tuple(block.shape)}")
            local.copy_(block)
        else:  # the same Parameter object (references and attributes stay valid), now with storage
            real = torch.nn.Parameter(full.to(on), requires_grad=param.requires_grad)
            real.__dict__.update(vars(param))
            torch.utils.swap_tensors(param, real)


def materialize(root: torch.nn.Module, rng: Optional[RngStates], init_dtypes: Dict[str, torch.dtype],
                init_device: torch.device) -> None:
    """Draw every parameter of ``root`` (built under :func:`meta_device_build`, possibly sharded since) as the
    ordinary build would have, keeping this rank's part (module docstring).

    ``init_dtypes``: the dtype each parameter (by qualified name) was created with (the FSDP wrapper keeps fp32
    main weights of bf16 parameters: they are drawn in bf16 and widened, as without the flag); ``init_device``: where
    the build would have drawn them (``megatron.core.transformer.norms.init_device``); ``rng``: the states the build
    started from (None: continue from the present states, for a second model chunk). DTensor parameters must have
    their local blocks allocated already (:func:`allocate_sharded`)."""
    owners = _owners(root)
    _check_covered(root, owners)
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    on = _device.current_device()
    done = set()
    if rng is not None:
        rng.restore()
    for owner in owners:
        swapped = []  # (module, name, the parameter, the fresh one)
        fresh_of: Dict[int, torch.nn.Parameter] = {}
        for module in owner.modules():
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) in done:
                    raise MetaInitError(f"{FLAG}: the parameter {names[id(module)]}.{pname} is shared with an "
                                        "earlier layer; drop " + FLAG)
                if id(param) not in fresh_of:
                    qualified = f"{names[id(module)]}.{pname}".lstrip(".")
                    dtype = init_dtypes.get(qualified, param.dtype)
                    fresh_of[id(param)] = torch.nn.Parameter(
                        torch.zeros(tuple(param.shape), dtype=dtype, device=init_device),
                        requires_grad=param.requires_grad)
                swapped.append((module, pname, param, fresh_of[id(param)]))
                module._parameters[pname] = fresh_of[id(param)]
        try:
            owner.reset_parameters()
        finally:
            for module, pname, param, _ in swapped:
                module._parameters[pname] = param
        for module, pname, param, fresh in swapped:
            if id(param) not in done:
                _place(param, fresh.data.to(param.dtype), on)
                done.add(id(param))
    for name, tensor in list(root.named_parameters()) + list(root.named_buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_meta:
            raise MetaInitError(f"{FLAG}: {name} is still on the meta device after materialisation: drop {FLAG}")


def allocate_sharded(root: torch.nn.Module, on: torch.device) -> None:
    """Allocate the (uninitialised) local blocks of an FSDP2 module built on the meta device; buffers, which the
    build created on their device, keep their values, and parameters the attributes Megatron hangs on them
    (``to_empty`` swaps each parameter's contents, ``__dict__`` included)."""
    buffers = {name: b.detach().clone() for name, b in root.named_buffers() if not b.is_meta}
    attributes = [(p, dict(vars(p))) for p in root.parameters()]
    root.to_empty(device=on)
    with torch.no_grad():
        for name, b in root.named_buffers():
            if name in buffers:  # a meta buffer is reported by materialize
                b.copy_(buffers[name])
    for param, values in attributes:
        param.__dict__.update(values)
