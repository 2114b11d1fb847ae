"""Tensor-parallel MLP: h -> ffn (column parallel) -> activation -> h (row parallel).

With a gated linear unit (``--swiglu``: ``gated_linear_unit=True, activation_func=F.silu``) the first linear
produces ``2 * ffn`` features; on every TP rank its local output is ``[gate_shard; up_shard]`` and the
activation is ``act(gate) * up``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.fusions import fused_kernels
from megatron.core.transformer.legacy_names import install_legacy_state_dict_names
from megatron.core.activations import erf_gelu, openai_gelu, squared_relu
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.utils import log_once
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec


def glu_activation(config):
    """The gated unit of ``config`` on fc1's output ``[a | l]`` (halves of the last dimension):
    ``act(min(a, c)) * (clamp(l, -c, c) + offset)`` with ``c = activation_func_clamp_value`` (no clamp when None) and
    ``offset = glu_linear_offset``; SwiGLU is ``act = silu`` with neither, gpt-oss ``quick_gelu`` with c = 7,
    offset 1 (Hugging Face GptOss's gate)."""
    act, offset, clamp = config.activation_func, config.glu_linear_offset, config.activation_func_clamp_value

    def glu(x):
        gate, linear = torch.chunk(x, 2, dim=-1)
        if clamp is not None:
            gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
        if offset:
            linear = linear + offset
        return act(gate) * linear

    return glu


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron's default FFN size with ``--swiglu`` and no ``--ffn-hidden-size``: 2/3 of 4h, rounded down to 64.

    Two input projections instead of one keep the parameter count close to the 4h GeLU MLP.
    """
    return int((4 * hidden_size * 2 / 3) / 64) * 64


@dataclass
class MLPSubmodules:
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None


def _class_of(spec, default):
    if spec is None:
        return default
    return spec.module if isinstance(spec, ModuleSpec) else spec


class ParallelMLP(MegatronModule):
    """``ParallelMLP(config)``; ``forward(hidden_states) -> (output, output_bias)``."""

    def __init__(self, config, is_expert: bool = False, *, naming: str = "legacy", submodules=None,
                 input_size=None, ffn_hidden_size=None, tp_group=None):
        super().__init__(config=config)
        if naming == "legacy":  # Megatron's legacy checkpoint names, at the state-dict boundary only
            install_legacy_state_dict_names(self, "mlp")
        self.add_bias = config.add_bias_linear
        self.is_expert = is_expert
        self.tp_group = tp_group  # the linear layers' TP group; None = parallel_state's
        self.input_size = config.hidden_size if input_size is None else input_size
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        fc1_size = 2 * ffn if config.gated_linear_unit else ffn
        linear_group = {} if tp_group is None else {"tp_group": tp_group}

        col = _class_of(getattr(submodules, "linear_fc1", None), tensor_parallel.ColumnParallelLinear)
        row = _class_of(getattr(submodules, "linear_fc2", None), tensor_parallel.RowParallelLinear)
        self.linear_fc1 = col(self.input_size, fc1_size, config=config, init_method=config.init_method,
                              bias=self.add_bias, gather_output=False, skip_bias_add=True, **linear_group)

        self.bias_gelu_fusion = False
        self.bias_swiglu_fusion = False
        self.gated = config.gated_linear_unit
        if self.gated:
            act = config.activation_func
            self.activation_func = glu_activation(config)
            plain = not config.glu_linear_offset and config.activation_func_clamp_value is None
            # --bias-swiglu-fusion (config.bias_activation_fusion): bias add + silu(a) * b in one kernel.
            self.bias_swiglu_fusion = bool(config.bias_activation_fusion) and act is F.silu and plain
            name = f"gated {getattr(act, '__name__', 'activation')} (swiglu when silu)"
            if not plain:
                name += (f", linear offset {config.glu_linear_offset}, clamp {config.activation_func_clamp_value} "
                         "(plain PyTorch)")
            if self.bias_swiglu_fusion:
                name = "fused bias-swiglu"
        elif config.openai_gelu:
            self.activation_func, name = openai_gelu, "openai_gelu (tanh approximation)"
        elif config.onnx_safe:
            self.activation_func, name = erf_gelu, "erf_gelu"
        elif config.squared_relu:
            self.activation_func, name = squared_relu, "squared_relu"
        else:
            self.activation_func = config.activation_func
            self.bias_gelu_fusion = config.bias_gelu_fusion and self.add_bias and config.activation_func is F.gelu
            name = "fused bias-gelu" if self.bias_gelu_fusion else getattr(config.activation_func, "__name__", "custom")
        log_once("mlp_activation", f"MLP activation: {name}")

        self.linear_fc2 = row(ffn, config.hidden_size, config=config,
                              init_method=config.output_layer_init_method, bias=self.add_bias,
                              input_is_parallel=True, skip_bias_add=True, **linear_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The linear layers' sharded state; with a gated unit, fc1's weight and bias are saved as megatron-core
        does (:func:`apply_swiglu_sharded_factory`)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.gated:
            apply_swiglu_to_fc1(out, prefix, sharded_offsets, metadata)
        return out

    def forward(self, hidden_states):
        intermediate_parallel, bias_parallel = self.linear_fc1(hidden_states)
        if self.bias_gelu_fusion:
            intermediate_parallel = bias_gelu_impl(intermediate_parallel, bias_parallel)
        elif self.bias_swiglu_fusion:
            intermediate_parallel = fused_kernels.BIAS_SWIGLU(intermediate_parallel, bias_parallel,
                                                              flag_hint="--no-bias-swiglu-fusion")
        else:
            if bias_parallel is not None:
                intermediate_parallel = intermediate_parallel + bias_parallel
            intermediate_parallel = self.activation_func(intermediate_parallel)
        output, output_bias = self.linear_fc2(intermediate_parallel)
        return output, output_bias


class MLP(ParallelMLP):
    """megatron-core: ``MLP(config, submodules, is_expert=False, input_size=None, ffn_hidden_size=None,
    tp_group=None)`` with ``linear_fc1``/``linear_fc2``: ``input_size`` -> ``ffn_hidden_size`` -> hidden size
    (defaults: the config's), split over ``tp_group``."""

    def __init__(self, config, submodules: Optional[MLPSubmodules] = None, is_expert: bool = False,
                 input_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None, tp_group=None):
        super().__init__(config, is_expert, naming="mcore", submodules=submodules, input_size=input_size,
                         ffn_hidden_size=ffn_hidden_size, tp_group=tp_group)


def apply_swiglu_to_fc1(sharded_state_dict, prefix: str, sharded_offsets, metadata) -> None:
    """Replace, in place, the ``{prefix}linear_fc1.weight`` / ``.bias`` entries of a gated MLP's sharded state by
    their :func:`apply_swiglu_sharded_factory`."""
    singleton = bool((metadata or {}).get("singleton_local_shards", False))
    for name in ("weight", "bias"):
        key = f"{prefix}linear_fc1.{name}"
        if key in sharded_state_dict:
            sharded_state_dict[key] = apply_swiglu_sharded_factory(sharded_state_dict[key], sharded_offsets, singleton)


def apply_swiglu_sharded_factory(original_sh_ten, sharded_offsets, singleton_local_shards: bool = False):
    """A gated fc1 tensor (local rows ``[gate_r; up_r]`` on TP rank ``r`` of ``t``) saved as the global
    ``[gate (all ranks); up (all ranks)]``: two blocks, ``gate_r`` at block ``r`` and ``up_r`` at block ``t + r`` of
    ``2t`` along axis 0 — so the tensor reads back at any TP. ``singleton_local_shards`` stores them under
    ``{key}_w`` / ``{key}_v`` instead (block ``r`` of ``t`` each). Loading concatenates the two halves."""
    axis = len(sharded_offsets)
    local_rows = original_sh_ten.local_shape[0]
    rank = original_sh_ten.global_offset[axis] // local_rows
    fragments = original_sh_ten.axis_fragmentations[axis]

    @torch.no_grad()
    def build(key, tensor, replica_id, flattened_range):
        gate, up = torch.chunk(tensor, 2, dim=0)
        if singleton_local_shards:
            placed = ((f"{key}_w", gate, rank, fragments), (f"{key}_v", up, rank, fragments))
        else:
            placed = ((key, gate, rank, 2 * fragments), (key, up, fragments + rank, 2 * fragments))
        return [ShardedTensor.from_rank_offsets(k, t, *sharded_offsets, (axis, offset, frags), replica_id=replica_id,
                                                prepend_axis_num=axis) for k, t, offset, frags in placed]

    def merge(halves):
        with torch.no_grad():
            return torch.cat(halves)

    return ShardedTensorFactory(original_sh_ten.key, original_sh_ten.data, build, merge, original_sh_ten.replica_id,
                                flattened_range=original_sh_ten.flattened_range)
