"""Megatron optimizers: a torch optimizer plus gradient plumbing, loss scaling, clipping and skipping.

* :class:`FP32Optimizer`: fp32 model, the torch optimizer works on the model parameters directly.
* :class:`Float16OptimizerWithFloat16Params`: fp16/bf16 model parameters, fp32 "main" copies that the torch
  optimizer updates; gradients are copied (and up-cast) from ``main_grad`` into the main parameters,
  unscaled and checked for inf/NaN, and the updated main parameters are copied back into the model.
* ``DistributedOptimizer`` (``distrib_optimizer.py``) shards the main parameters and optimizer state over
  the data-parallel group.
* :class:`ChainedOptimizer`: several of the above over disjoint parameter sets, stepped as one.

``step()`` = ``prepare_grads()`` (gradients into place, unscaled; True on inf/NaN), then clipping to the global
norm and counting zeros, then ``step_with_ready_grads()``; it returns ``(update_successful, grad_norm,
num_zeros_in_grad)``. A step whose gradients overflowed (fp16) is skipped: the parameters and the optimizer state
are left untouched and the loss scaler backs off.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

import torch

from megatron.core import device as _device
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.process_groups_config import pg_group, pg_size
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    get_grad_norm_fp32,
    count_zeros_fp32,
    param_is_not_shared,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes, param_is_not_tensor_parallel_duplicate
from megatron.core.utils import print_rank_0


def _zero_grad_group_helper(group: List[torch.Tensor], set_to_none: bool):
    for param in group:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def _expert_groups_separate(pg_collection=None) -> bool:
    """Whether expert-parallel groups differ from the dense ones (EP > 1 or expert TP != TP): same on every rank."""
    ep, etp, tp = (pg_size(pg_collection, name) for name in ("ep", "expt_tp", "tp"))
    return ep > 1 or etp != tp


def _model_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The accumulated, DP-reduced gradient of a model parameter: ``main_grad`` (DDP buffer) else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


class MegatronOptimizer(ABC):
    """Base class: owns the torch optimizer (``self.optimizer``) and the config. ``pg_collection`` (set by
    ``get_megatron_optimizer``; None: parallel_state's groups): ``mp`` sums the gradient norm, zero counts and overflow
    flags, ``tp_ep_pp`` the expert gradients' norm."""

    pg_collection = None

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig):
        if optimizer is None:
            raise ValueError("no torch optimizer was given")
        self.optimizer = optimizer
        self.config = config
        # Number of inner optimizer steps taken (restored from checkpoints), see _inner_state_dict.
        self._inner_steps = 0

    # ------------------------------------------------------------------ parameters and gradients
    def get_parameters(self) -> List[torch.Tensor]:
        """The parameters the torch optimizer updates (main params for mixed precision / sharded optimizers)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """Gradients that count towards the global norm: each model piece once over TP and PP."""
        grads = []
        for param in self.get_parameters():
            if param.grad is None:
                continue
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, self._tp_group()):
                grads.append(param.grad.detach())
        return grads

    def _tp_group(self):
        """The collection's TP group (None: parallel_state's), which decides the TP duplicates of the norm."""
        return None if self.pg_collection is None else self.pg_collection.tp

    def get_model_parallel_group(self):
        """The group over which norms, zero counts and overflow flags are summed (None = world)."""
        return pg_group(self.pg_collection, "mp")

    def get_grad_norm(self) -> float:
        """The global L2 norm of the gradients (each model piece once), before clipping."""
        group = self.get_model_parallel_group()
        if group is None or not _expert_groups_separate(self.pg_collection):
            return get_grad_norm_fp32(self.get_main_grads_for_grad_norm(), 2, group)
        # Expert parallelism: dense pieces are unique over TP x PP, expert pieces over expert TP x EP x PP. Each
        # part's squares are summed over its own group into one total norm.
        dense, expert = [], []
        for param in self.get_parameters():
            if param.grad is None:
                continue
            if not getattr(param, "allreduce", True):
                expert.append(param.grad.detach())
            elif param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, self._tp_group()):
                dense.append(param.grad.detach())
        norm_dense = get_grad_norm_fp32(dense, 2, group)
        norm_expert = get_grad_norm_fp32(expert, 2, pg_group(self.pg_collection, "tp_ep_pp"))
        return (norm_dense ** 2 + norm_expert ** 2) ** 0.5

    def clip_grad_by_total_norm(self, clip_grad: float, total_norm: float):
        """Scale every gradient by ``clip_grad / (total_norm + 1e-6)`` when that is below 1."""
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, total_norm)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the gradients to a global norm of ``clip_grad``; return the norm before clipping."""
        total = self.get_grad_norm()
        self.clip_grad_by_total_norm(clip_grad, total)
        return total

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), model_parallel_group=self.get_model_parallel_group(),
                                tp_group=self._tp_group())

    # ------------------------------------------------------------------ loss scaling
    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What the schedules backpropagate (``config.grad_scale_func``): the loss times the loss scale."""
        return self.get_loss_scale() * loss

    # ------------------------------------------------------------------ torch optimizer passthrough
    @abstractmethod
    def zero_grad(self, set_to_none: bool = True):
        ...

    @abstractmethod
    def reload_model_params(self):
        """Refresh the optimizer's copies of the parameters after the model's were loaded from a checkpoint."""

    @abstractmethod
    def state_dict(self) -> dict:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict):
        ...

    def prepare_grads(self) -> bool:
        """Bring the gradients to where the torch optimizer reads them (and unscale them); True if some rank found
        inf / NaN, in which case the step must be skipped."""
        return False

    def step_with_ready_grads(self) -> bool:
        """The torch optimizer's step on prepared (and clipped) gradients, then the model parameters refreshed
        from the updated ones; True when the update happened."""
        with self._timed("optimizer-inner-step"):
            self._inner_step()
        return True

    @torch.no_grad()
    def step(self):
        """``prepare_grads``; skip on inf / NaN; clip and count zeros; ``step_with_ready_grads``. Returns
        ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        if self.prepare_grads():
            return False, None, None
        grad_norm, num_zeros = self._clip_and_count()
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def _get_state(self):
        return self.optimizer.state

    def _set_state(self, value):
        self.optimizer.state = value

    state = property(_get_state, _set_state)

    def _get_param_groups(self):
        return self.optimizer.param_groups

    def _set_param_groups(self, value):
        self.optimizer.param_groups = value

    param_groups = property(_get_param_groups, _set_param_groups)

    # ------------------------------------------------------------------ helpers
    def _inner_step(self):
        self.optimizer.step()
        self._inner_steps += 1

    def _inner_state_dict(self) -> dict:
        """``optimizer.state_dict()`` with Megatron's per-group ``'step'``.

        Megatron's checkpoints come from apex FusedAdam, which counts steps per param group; torch's Adam
        counts per parameter. Writing the group count too keeps our checkpoints loadable by either, and
        gives a count to groups that hold no parameter on this rank (distributed optimizer shards).
        """
        sd = self.optimizer.state_dict()
        for group in sd["param_groups"]:
            if "step" not in group:
                steps = [float(sd["state"][i]["step"]) for i in group["params"] if "step" in sd["state"].get(i, {})]
                group["step"] = int(max(steps)) if steps else self._inner_steps
        return sd

    def _load_inner_state_dict(self, state_dict: dict):
        """Load a state dict written by apex FusedAdam or torch Adam (see _inner_state_dict)."""
        # A checkpoint written before --decoupled-lr was added keeps this run's decoupled max/min lr.
        for saved, current in zip(state_dict["param_groups"], self.optimizer.param_groups):
            for key in ("is_decoupled_lr", "max_lr", "min_lr"):
                if key in current and key not in saved:
                    saved[key] = current[key]
        steps = [g["step"] for g in state_dict["param_groups"] if g.get("step") is not None]
        steps += [v["step"] for v in state_dict["state"].values() if "step" in v]
        self._inner_steps = int(max(float(s) for s in steps)) if steps else 0
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            state = {k: dict(v) for k, v in state_dict["state"].items()}
            for group in state_dict["param_groups"]:
                for i in group["params"]:
                    if i in state and "step" not in state[i]:
                        state[i]["step"] = torch.tensor(float(group.get("step", self._inner_steps)),
                                                        dtype=torch.float32)
            state_dict = {"state": state, "param_groups": state_dict["param_groups"]}
        self.optimizer.load_state_dict(state_dict)

    @contextmanager
    def _timed(self, name: str):
        timers = self.config.timers
        if timers is None:
            yield
            return
        timer = timers(name, log_level=1)
        timer.start(barrier=self.config.barrier_with_L1_time)
        try:
            yield
        finally:
            timer.stop()

    def _clip_and_count(self):
        grad_norm = None
        if self.config.clip_grad > 0.0:
            with self._timed("optimizer-clip-main-grad"):
                grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            with self._timed("optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        return grad_norm, num_zeros


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Shared logic of the fp16/bf16 optimizers: unscale, overflow check, skip, scaler update."""

    def __init__(self, optimizer, config: OptimizerConfig, grad_scaler: Optional[MegatronGradScaler]):
        super().__init__(optimizer, config)
        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)
        self.grad_scaler = grad_scaler
        if self.grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a loss scaler (constant --loss-scale or the dynamic one)")
        dev = _device.current_device()
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=dev)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _load_grad_scaler(self, state_dict: dict):
        """Restore the loss scaler from an optimizer state dict (older checkpoints may lack it)."""
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                print_rank_0("***WARNING*** found an old checkpoint, will not load grad scaler ...")
        elif self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        else:
            print_rank_0("***WARNING*** found the grad scaler in the checkpoint but it is None in the class. "
                         "Skipping loading grad scaler ...")

    @abstractmethod
    def _collect_main_grad_data_for_unscaling(self) -> List[torch.Tensor]:
        ...

    @abstractmethod
    def _copy_model_grads_to_main_grads(self):
        ...

    @abstractmethod
    def _copy_main_params_to_model_params(self):
        ...

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """Multiply the main grads by 1/scale; True if any rank of the group saw inf/NaN."""
        main_grads = self._collect_main_grad_data_for_unscaling()
        self.found_inf.fill_(0.0)
        if main_grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                main_grads, self.found_inf, self.grad_scaler.inv_scale.to(self.found_inf.device))
        # Every rank must take the same decision, or the model replicas/shards would diverge.
        # (Expert grads differ across expert-parallel ranks: then the whole world decides together.)
        torch.distributed.all_reduce(self.found_inf, op=torch.distributed.ReduceOp.MAX,
                                     group=None if _expert_groups_separate(self.pg_collection)
                                     else self.get_model_parallel_group())
        return self.found_inf.item() > 0

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy the model grads into the main grads; with a loss scaler, unscale them, check for inf / NaN over
        the group and update the scaler."""
        with self._timed("optimizer-copy-to-main-grad"):
            self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        with self._timed("optimizer-unscale-and-check-inf"):
            found_inf = self._unscale_main_grads_and_check_for_nan()
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        with self._timed("optimizer-inner-step"):
            self._inner_step()
        with self._timed("optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model_params()
        return True


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16/bf16 model parameters with fp32 main parameters owned by the torch optimizer.

    The torch optimizer's param groups are rewritten in place: every fp16/bf16 parameter is replaced by an
    fp32 clone (carrying the tensor-parallel, ``shared``, ``is_qkv`` and ``expert_tp`` attributes); fp32 parameters
    of the model stay.
    """

    def __init__(self, optimizer, config: OptimizerConfig, grad_scaler: Optional[MegatronGradScaler]):
        super().__init__(optimizer, config, grad_scaler)
        self.float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []

        for group in self.optimizer.param_groups:
            float16_params, fp32_from_float16, fp32_params = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in (torch.float16, torch.bfloat16):
                    float16_params.append(param)
                    main_param = param.detach().clone().float()
                    copy_tensor_model_parallel_attributes(main_param, param)
                    # What optimizers read from a parameter: shared (norm counting), Muon's is_qkv / expert_tp.
                    for flag in ("shared", "is_qkv", "expert_tp"):
                        if hasattr(param, flag):
                            setattr(main_param, flag, getattr(param, flag))
                    group["params"][i] = main_param
                    fp32_from_float16.append(main_param)
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                    group["params"][i] = param
                else:
                    raise TypeError(f"wrapped parameters must be float32, float16 or bfloat16, got {param.dtype}")
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(fp32_from_float16)
            self.fp32_from_fp32_groups.append(fp32_params)

    def zero_grad(self, set_to_none: bool = True):
        """Clear the model grads (fp16 and fp32) and the main grads; the DDP buffers are zeroed by DDP."""
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def _collect_main_grad_data_for_unscaling(self):
        grads = []
        for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                grads.extend(p.grad.data for p in group if p.grad is not None)
        return grads

    def _copy_model_grads_to_main_grads(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                grad = _model_grad(model_param)
                main_param.grad = grad.float() if grad is not None else None
                # Drop the fp16 .grad now so that only one copy of the gradient lives on.
                model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for param in group:
                grad = _model_grad(param)
                if grad is not None:
                    param.grad = grad

    def _copy_main_params_to_model_params(self):
        model, main = self._flat_model_and_main()
        if model:
            torch._foreach_copy_(model, main)

    def _copy_model_params_to_main_params(self):
        model, main = self._flat_model_and_main()
        if main:
            torch._foreach_copy_(main, model)

    def _flat_model_and_main(self):
        model, main = [], []
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                model.append(model_param.data)
                main.append(main_param.data)
        return model, main

    def reload_model_params(self):
        self._copy_model_params_to_main_params()

    def state_dict(self) -> dict:
        state_dict = {"optimizer": self._inner_state_dict()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        state_dict["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state_dict

    def load_state_dict(self, state_dict: dict):
        optimizer_key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        if optimizer_key == "optimizer_state_dict":
            print_rank_0("***WARNING*** loading optimizer from an old checkpoint ...")
        self._load_inner_state_dict(state_dict[optimizer_key])

        self._load_grad_scaler(state_dict)

        key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        saved_groups = state_dict[key]
        if len(saved_groups) != len(self.fp32_from_float16_groups):
            raise ValueError(f"optimizer checkpoint has {len(saved_groups)} groups of fp32 main params, this model "
                             f"has {len(self.fp32_from_float16_groups)}: the model or --weight-decay rules differ")
        for current_group, saved_group in zip(self.fp32_from_float16_groups, saved_groups):
            if len(current_group) != len(saved_group):
                raise ValueError("optimizer checkpoint's fp32 main params do not match the model's parameters")
            for current, saved in zip(current_group, saved_group):
                current.data.copy_(saved.data)


class FP32Optimizer(MegatronOptimizer):
    """fp32 training: the torch optimizer updates the model parameters; ``.grad`` is pointed at ``main_grad``."""

    def __init__(self, optimizer, config: OptimizerConfig):
        super().__init__(optimizer, config)
        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)
        self._scale = torch.ones(1, dtype=torch.float32, device=_device.current_device())

    def zero_grad(self, set_to_none: bool = True):
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Point every parameter's ``.grad`` at its DDP ``main_grad``; fp32 never skips a step."""
        with self._timed("optimizer-copy-to-main-grad"):
            for param in self.get_parameters():
                main_grad = getattr(param, "main_grad", None)
                if main_grad is not None:
                    param.grad = main_grad
        return False

    def reload_model_params(self):
        pass

    def state_dict(self) -> dict:
        return self._inner_state_dict()

    def load_state_dict(self, state_dict: dict):
        self._load_inner_state_dict(state_dict)



class ProxyDict:
    """A read-write view of a list of dicts as one dict keyed ``(index of the dict, key inside it)``:
    ``ProxyDict([{"a": 1}, {"b": 2}])`` holds ``{(0, "a"): 1, (1, "b"): 2}``. A missing key reads as None."""

    def __init__(self, inner_dicts: List[dict]):
        self._inner_dicts = inner_dicts

    def __getitem__(self, key: Tuple[int, Any]):
        index, inner_key = key
        return self._inner_dicts[index].get(inner_key)

    def __setitem__(self, key: Tuple[int, Any], value: Any):
        index, inner_key = key
        self._inner_dicts[index][inner_key] = value

    def __len__(self) -> int:
        return sum(len(inner) for inner in self._inner_dicts)

    def __iter__(self) -> Iterator[Tuple[int, Any]]:
        for index, inner in enumerate(self._inner_dicts):
            for inner_key in inner:
                yield index, inner_key

    def items(self):
        """``((index, key), value)`` over every inner dict in order."""
        for index, inner in enumerate(self._inner_dicts):
            for inner_key, value in inner.items():
                yield (index, inner_key), value


class ChainedOptimizer(MegatronOptimizer):
    """Several Megatron optimizers over disjoint parameter sets (dense and expert parameters, Muon and Adam ...)
    stepped as one.

    ``step()``: every optimizer prepares its gradients; if any found inf / NaN all skip. Otherwise the global
    gradient norm is ``sqrt(sum_i norm_i^2)`` over the optimizers' own norms (each over its own groups), every
    optimizer with ``clip_grad > 0`` scales its gradients by ``clip_grad / (norm + 1e-6)`` when below 1, zeros are
    counted (``log_num_zeros_in_grad``) and every optimizer steps. ``param_groups`` is the concatenation of the
    optimizers' groups, ``state`` a :class:`ProxyDict` keyed ``(optimizer index, param)``; ``state_dict()`` is the
    single optimizer's own, or the list of all of them. All optimizers must share one config.
    """

    def __init__(self, chained_optimizers: List[MegatronOptimizer]):
        self.chained_optimizers = chained_optimizers
        self.model_chunks = []
        self.config = getattr(chained_optimizers[0], "config", None) if chained_optimizers else None
        for optimizer in chained_optimizers:
            if getattr(optimizer, "config", None) != self.config:
                raise ValueError("ChainedOptimizer: the chained optimizers must share one OptimizerConfig")
            for chunk in getattr(optimizer, "model_chunks", []):
                if not any(chunk is known for known in self.model_chunks):
                    self.model_chunks.append(chunk)
        # No optimizer (a rank without trainable parameters), or only stubs: this one is a stub too.
        self.is_stub_optimizer = all(getattr(opt, "is_stub_optimizer", False) for opt in chained_optimizers)
        self._inner_steps = 0

    @property
    def optimizer(self):
        """The torch optimizer of the only chained optimizer (an error with several)."""
        if len(self.chained_optimizers) != 1:
            raise AttributeError(f"ChainedOptimizer.optimizer: {len(self.chained_optimizers)} optimizers are "
                                 "chained; use chained_optimizers[i].optimizer")
        return self.chained_optimizers[0].optimizer

    @property
    def param_groups(self) -> List[dict]:
        return [group for optimizer in self.chained_optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> ProxyDict:
        return ProxyDict([optimizer.state for optimizer in self.chained_optimizers])

    def get_parameters(self) -> List[torch.Tensor]:
        return [p for optimizer in self.chained_optimizers for p in optimizer.get_parameters()]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return [g for optimizer in self.chained_optimizers for g in optimizer.get_main_grads_for_grad_norm()]

    def zero_grad(self, set_to_none: bool = True):
        for optimizer in self.chained_optimizers:
            optimizer.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        if self.chained_optimizers:
            return self.chained_optimizers[0].get_loss_scale()
        return torch.ones(1, dtype=torch.float32, device=_device.current_device())

    def reload_model_params(self, state_dict=None):
        """Every optimizer refreshes its copies from the model parameters (``state_dict`` is not needed: the
        main parameters are rebuilt from the model's own)."""
        for optimizer in self.chained_optimizers:
            optimizer.reload_model_params()

    def state_dict(self):
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [optimizer.state_dict() for optimizer in self.chained_optimizers]

    def load_state_dict(self, state_dict):
        """The single optimizer's state dict, or one per optimizer (a list, or a dict read in key order)."""
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if len(state_dict) != len(self.chained_optimizers):
            raise RuntimeError(f"Expected {len(self.chained_optimizers)} entries in state dict, but got "
                               f"{len(state_dict)}.")
        if isinstance(state_dict, dict):
            state_dict = [value for _, value in sorted(state_dict.items())]
        for optimizer, state in zip(self.chained_optimizers, state_dict):
            optimizer.load_state_dict(state)
        self._synchronize_steps()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = False
        for optimizer in self.chained_optimizers:
            found_inf |= bool(optimizer.prepare_grads())
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        success = True
        for optimizer in self.chained_optimizers:
            success &= bool(optimizer.step_with_ready_grads())
        return success

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].get_grad_norm()
        return sum(float(optimizer.get_grad_norm() or 0.0) ** 2 for optimizer in self.chained_optimizers) ** 0.5

    def clip_grad_by_total_norm(self, clip_grad: float, total_norm: float):
        for optimizer in self.chained_optimizers:
            optimizer.clip_grad_by_total_norm(clip_grad, total_norm)

    @torch.no_grad()
    def count_zeros(self) -> int:
        return sum(optimizer.count_zeros() for optimizer in self.chained_optimizers)

    @torch.no_grad()
    def step(self):
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm()
        for optimizer in self.chained_optimizers:
            if optimizer.config.clip_grad > 0.0 and not getattr(optimizer, "is_stub_optimizer", False):
                optimizer.clip_grad_by_total_norm(optimizer.config.clip_grad, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def save_parameter_state(self, filename: str):
        """Distributed optimizers' gathered states: the single one's file, or a list with one entry per chained
        optimizer (None for those that are not distributed or not gathered on this rank)."""
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].save_parameter_state(filename)
            return
        states = [opt.get_parameter_state() if hasattr(opt, "get_parameter_state") else None
                  for opt in self.chained_optimizers]
        if any(state is not None for state in states):
            torch.save(states, filename)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False):
        """Inverse of :meth:`save_parameter_state` (collective); the file is read on the gathering ranks."""
        if update_legacy_format:
            raise NotImplementedError("load_parameter_state(update_legacy_format=True): the legacy distributed "
                                      "optimizer formats are not converted")
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_parameter_state(filename)
            return
        distributed = [opt for opt in self.chained_optimizers if hasattr(opt, "load_parameter_state")]
        root = any(opt.is_parameter_state_root() for opt in distributed)
        states = torch.load(filename, map_location="cpu", weights_only=False) if root else None
        for index, optimizer in enumerate(self.chained_optimizers):
            if hasattr(optimizer, "load_parameter_state"):
                optimizer.load_parameter_state(states[index] if states else None)

    def _synchronize_steps(self):
        """One step count for every non-empty param group that keeps one (apex / TE FusedAdam count per group and
        skip empty groups); returns it (None when no group keeps a count)."""
        steps = {group["step"] for opt in self.chained_optimizers for group in opt.optimizer.param_groups
                 if group["params"] and "step" in group}
        if len(steps) > 1:
            raise RuntimeError(f"ChainedOptimizer: the chained optimizers disagree on the step count: {steps}")
        step = next(iter(steps), None)
        for opt in self.chained_optimizers:
            for group in opt.optimizer.param_groups:
                if group["params"] and "step" in group:
                    group["step"] = step
        return step
