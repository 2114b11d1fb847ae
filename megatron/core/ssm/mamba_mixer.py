"""Mamba-2 mixer (megatron-core's ``MambaMixer``) in pure PyTorch, tensor-parallel as Megatron splits it.

Sizes: ``H`` heads of dim ``P`` (``d_inner = H·P``; ``H = 2h/P`` unless ``mamba_num_heads`` is set), ``G`` groups of
state dim ``N``, conv kernel ``K = 4``. On each of ``t`` tensor-parallel ranks the mixer holds ``H/t`` heads and
``G/t`` groups. For ``u [s, b, h]`` (already normalised by the layer's pre-norm):

1. ``in_proj`` (column parallel, no bias) gives, per rank, ``[z | x | B | C | dt]`` of sizes
   ``d_inner/t, d_inner/t, GN/t, GN/t, H/t`` (the global weight is ``[z; x; B; C; dt]`` and rank ``r`` holds the
   ``r``-th slice of each of the five blocks);
2. ``xBC = SiLU(causal depthwise conv1d(cat(x, B, C)))`` with a bias (channels ``[x_r; B_r; C_r]``);
3. ``Δ = softplus(dt + dt_bias)`` (no clamp), ``A = -exp(A_log)``;
4. the selective scan of :mod:`megatron.core.ssm.ssd_chunked_scan` (chunks of 128), ``y += D x``;
5. ``y = RMSNorm_G(y ⊙ SiLU(z)) · norm.weight``: the norm runs over each group's ``d_inner/G`` channels (eps 1e-5);
6. ``out_proj`` (row parallel, no bias): ``(output, None)``.

Initialisation (the full global tensors are drawn, then sliced, so every TP size starts from the same model):
``in_proj`` / ``out_proj`` from the config's init methods, the conv like ``nn.Conv1d`` (uniform ±1/√K),
``A ~ U(1, 16)``, ``dt = exp(U(ln dt_min, ln dt_max))`` clamped at ``dt_init_floor`` with
``dt_bias = dt + ln(-expm1(-dt))`` (softplus⁻¹), ``D = 1``, norm weight 1.

Megatron's training path fuses steps 2-4 and the gating into the ``mamba_ssm`` Triton kernels
(``--disable-mamba-mem-eff-path`` turns that off); here both settings run these PyTorch ops (logged once).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import group_of, pg_rank, pg_size
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.utils import log_once
from megatron.core.ssm.ssd_chunked_scan import causal_depthwise_conv1d, ssd_chunked_scan
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import weights_on_meta
from megatron.core.transformer.spec_utils import ModuleSpec

GATED_NORM_EPS = 1e-5  # megatron-core hard-codes the gated group norm's epsilon


@dataclass
class MambaMixerSubmodules:
    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


@dataclass(frozen=True)
class MambaDims:
    """The mixer's global sizes (see the module docstring)."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    state: int

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def in_proj_parts(self) -> List[Tuple[str, int]]:
        """Global row blocks of ``in_proj.weight`` in order: z, x, B, C, dt."""
        gn = self.groups * self.state
        return [("z", self.d_inner), ("x", self.d_inner), ("B", gn), ("C", gn), ("dt", self.heads)]

    @property
    def conv_parts(self) -> List[Tuple[str, int]]:
        """Global channel blocks of the conv: x, B, C."""
        return self.in_proj_parts[1:4]


def mamba_dims(config, hidden_size: Optional[int] = None) -> MambaDims:
    """The mixer sizes a config describes; ValueError naming the flags when they do not fit together."""
    h = hidden_size or config.hidden_size
    head_dim, groups = config.mamba_head_dim, config.mamba_num_groups
    heads = config.mamba_num_heads
    if heads is None:
        if (2 * h) % head_dim:
            raise ValueError(f"--mamba-head-dim ({head_dim}) must divide 2 x --hidden-size ({2 * h}) when "
                             "--mamba-num-heads is not given")
        heads = 2 * h // head_dim
    if heads % groups:
        raise ValueError(f"the Mamba heads ({heads}) must be a multiple of --mamba-num-groups ({groups})")
    tp = config.tensor_model_parallel_size
    if heads % tp or groups % tp:
        raise ValueError(f"the Mamba heads ({heads}) and --mamba-num-groups ({groups}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    return MambaDims(h, heads, head_dim, groups, config.mamba_state_dim)


def rank_rows(parts: List[Tuple[str, int]], tp: int, rank: int) -> torch.Tensor:
    """Indices (into the global concatenation of ``parts``) of rank ``rank``'s slice of each block, in order."""
    out, start = [], 0
    for _, size in parts:
        local = size // tp
        out.append(torch.arange(start + rank * local, start + (rank + 1) * local))
        start += size
    return torch.cat(out)


def _mark_tp(param: torch.nn.Parameter) -> None:
    set_tensor_model_parallel_attributes(param, True, 0, 1)


class MambaMixer(MegatronModule):
    """``MambaMixer(config, submodules, d_model, d_conv=4, A_init_range=(1, 16), dt_min=0.001, dt_max=0.1,
    dt_init_floor=1e-4, conv_bias=True, chunk_size=128, layer_number=None, ..., pg_collection=None)``;
    ``forward(hidden_states [s, b, h]) -> (output [s, b, h], None)``. The collection's ``tp`` group (else
    parallel_state's) splits the heads, groups and channels."""

    def __init__(self, config, submodules: MambaMixerSubmodules = None, d_model: Optional[int] = None,
                 d_conv: int = 4, A_init_range: Tuple[float, float] = (1, 16), dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4, conv_bias: bool = True, chunk_size: int = 128,
                 layer_number: Optional[int] = None, bias: bool = False, rmsnorm: bool = True,
                 norm_before_gate: bool = False, D_has_hdim: bool = False, pg_collection=None):
        super().__init__(config=config)
        if bias or not rmsnorm or norm_before_gate or D_has_hdim:
            raise ValueError("MambaMixer implements megatron-core's defaults only: bias=False, rmsnorm=True, "
                             "norm_before_gate=False, D_has_hdim=False")
        submodules = submodules or MambaMixerSubmodules()
        self.dims = dims = mamba_dims(config, d_model)
        self.layer_number = layer_number
        self.chunk_size = chunk_size
        self.d_conv = d_conv
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        tp = pg_size(pg_collection, "tp")
        groups = {} if self.tp_group is None else {"tp_group": self.tp_group}
        self.heads, self.groups = dims.heads // tp, dims.groups // tp
        self.d_inner = dims.d_inner // tp
        log_once("mamba_scan", "Mamba-2 mixer: PyTorch causal conv1d + chunked SSD scan (no mamba_ssm / "
                 "causal_conv1d kernels); the same math with and without --disable-mamba-mem-eff-path")

        in_cls = _module_class(submodules.in_proj, tensor_parallel.ColumnParallelLinear)
        out_cls = _module_class(submodules.out_proj, tensor_parallel.RowParallelLinear)
        in_rows = sum(size for _, size in dims.in_proj_parts)
        self.in_proj = in_cls(dims.hidden, in_rows, config=config, init_method=_no_init, bias=False,
                              gather_output=False, skip_bias_add=True, **groups)
        conv_channels = sum(size for _, size in dims.conv_parts)
        kwargs = {"dtype": config.params_dtype, "device": self.in_proj.weight.device}
        # skip_init: nn.Conv1d's own init would draw a TP-dependent number of values from the default generator (the
        # weights below are drawn whole and sliced, so that every TP size initialises the same model).
        self.conv1d = torch.nn.utils.skip_init(torch.nn.Conv1d, conv_channels // tp, conv_channels // tp, d_conv,
                                               groups=conv_channels // tp, padding=d_conv - 1, bias=conv_bias, **kwargs)
        self.A_log = torch.nn.Parameter(torch.empty(self.heads, dtype=torch.float32, device=kwargs["device"]))
        self.D = torch.nn.Parameter(torch.empty(self.heads, dtype=torch.float32, device=kwargs["device"]))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.heads, **kwargs))
        self.norm = _GroupRMSNorm(self.d_inner, self.groups, **kwargs)
        self.out_proj = out_cls(dims.d_inner, dims.hidden, config=config, init_method=config.output_layer_init_method,
                                bias=False, input_is_parallel=True, skip_bias_add=True, **groups)
        for p in (self.conv1d.weight, self.conv1d.bias, self.A_log, self.D, self.dt_bias, self.norm.weight):
            if p is not None:
                _mark_tp(p)
        self._init_ranges = (A_init_range, dt_min, dt_max, dt_init_floor)
        self._initialize_or_conv_default()

    def reset_parameters(self):
        """The submodules' draws, then the mixer's, in the constructor's order."""
        for child in (self.in_proj, self.out_proj):
            child.reset_parameters()
        with torch.no_grad():
            self.norm.weight.fill_(1.0)
        self._initialize_or_conv_default()

    def _initialize_or_conv_default(self):
        """The mixer's draws (:meth:`_initialize`); without ``perform_initialization``, torch's own conv values."""
        if self.config.perform_initialization:
            self._initialize()
        else:
            self.conv1d.reset_parameters()

    @torch.no_grad()
    def _initialize(self):
        if weights_on_meta(self):
            return
        dims = self.dims
        A_init_range, dt_min, dt_max, dt_init_floor = self._init_ranges
        tp, tp_rank = pg_size(self.pg_collection, "tp"), pg_rank(self.pg_collection, "tp")
        rows = rank_rows(dims.in_proj_parts, tp, tp_rank)
        weight = torch.empty(sum(s for _, s in dims.in_proj_parts), dims.hidden, dtype=torch.float32)
        self.config.init_method(weight)
        self.in_proj.weight.copy_(weight[rows])
        channels = rank_rows(dims.conv_parts, tp, tp_rank)
        bound = 1.0 / math.sqrt(self.d_conv)  # nn.Conv1d's default for a depthwise kernel (fan-in K)
        conv_w = torch.empty(sum(s for _, s in dims.conv_parts), 1, self.d_conv).uniform_(-bound, bound)
        self.conv1d.weight.copy_(conv_w[channels])
        if self.conv1d.bias is not None:
            conv_b = torch.empty(conv_w.shape[0]).uniform_(-bound, bound)
            self.conv1d.bias.copy_(conv_b[channels])
        heads = slice(tp_rank * self.heads, (tp_rank + 1) * self.heads)
        A = torch.empty(dims.heads, dtype=torch.float32).uniform_(*A_init_range)
        self.A_log.copy_(torch.log(A)[heads])
        dt = torch.exp(torch.rand(dims.heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt)))[heads])
        self.D.fill_(1.0)
        self.norm.weight.fill_(1.0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The default (``A_log``, ``D``, ``dt_bias``, the conv and the gated norm split over TP on axis 0,
        ``in_proj`` on axis 0, ``out_proj`` on axis 1), with ``in_proj.weight`` stored as the five global tensors
        ``in_proj.weight.{z,x,B,C,dt}`` and ``conv1d.{weight,bias}`` as ``.{x,B,C}`` (a rank's local rows are its
        slice of each), as megatron-core does: the checkpoint does not depend on TP."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        gn = self.groups * self.dims.state
        names = [name for name, _ in self.dims.in_proj_parts]
        out[f"{prefix}in_proj.weight"] = split_tensor_factory(
            out[f"{prefix}in_proj.weight"], [self.d_inner, self.d_inner, gn, gn, self.heads], names, 0)
        for name in ("conv1d.weight", "conv1d.bias"):
            if f"{prefix}{name}" in out:
                out[f"{prefix}{name}"] = split_tensor_factory(out[f"{prefix}{name}"], [self.d_inner, gn, gn],
                                                              names[1:4], 0)
        return out

    def forward(self, hidden_states: torch.Tensor, inference_params=None):
        if inference_params is not None:
            raise NotImplementedError("MambaMixer: incremental decoding (inference_params) is not implemented")
        projected, _ = self.in_proj(hidden_states)                   # [s, b, local rows]
        seq, batch = projected.shape[:2]
        gn = self.groups * self.dims.state
        z, xBC, dt = torch.split(projected, [self.d_inner, self.d_inner + 2 * gn, self.heads], dim=-1)
        xBC = causal_depthwise_conv1d(xBC.permute(1, 2, 0), self.conv1d.weight, self.conv1d.bias)
        xBC = F.silu(xBC).permute(0, 2, 1)                            # [b, s, channels]
        x, B, C = torch.split(xBC, [self.d_inner, gn, gn], dim=-1)
        dt = F.softplus(dt.transpose(0, 1).float() + self.dt_bias.float())  # [b, s, H/t]
        A = -torch.exp(self.A_log.float())
        y = ssd_chunked_scan(x.reshape(batch, seq, self.heads, self.dims.head_dim), dt, A,
                             B.reshape(batch, seq, self.groups, self.dims.state),
                             C.reshape(batch, seq, self.groups, self.dims.state), D=self.D, chunk_size=self.chunk_size,
                             state_dtype=self._state_dtype())
        y = y.reshape(batch, seq, self.d_inner).transpose(0, 1)        # [s, b, d_inner/t]
        y = self.norm(y, z)
        out, out_bias = self.out_proj(y.to(hidden_states.dtype))
        return out, out_bias


    def mamba_state_shapes_per_request(self) -> Tuple[Tuple[int, int], Tuple[int, int, int]]:
        """The inference state one sequence needs on this TP rank (megatron-core's): the conv state
        ``(conv channels, d_conv)`` and the SSM state ``(heads, head dim, state dim)``."""
        return (self.conv1d.weight.shape[0], self.d_conv), (self.heads, self.dims.head_dim, self.dims.state)

    def _state_dtype(self):
        """bfloat16 for the inter-chunk states in training with --mamba-training-ssm-states-dtype bf16."""
        if self.training and self.config.mamba_training_ssm_states_dtype == "bf16":
            return torch.bfloat16
        return None


class _GroupRMSNorm(torch.nn.Module):
    """``RMSNorm`` of ``y ⊙ SiLU(z)`` over each of ``groups`` blocks of channels, times ``weight`` (fp32 math)."""

    def __init__(self, channels: int, groups: int, dtype=None, device=None):
        super().__init__()
        self.groups = groups
        self.weight = torch.nn.Parameter(torch.ones(channels, dtype=dtype, device=device))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        grouped = gated.view(*gated.shape[:-1], self.groups, -1)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + GATED_NORM_EPS)
        return (normed.view_as(gated) * self.weight.float()).to(y.dtype)


def split_tensor_factory(sharded: ShardedTensor, sections: List[int], names: List[str], dim: int):
    """``sharded`` (a TP-split tensor) saved as ``len(sections)`` tensors ``{key}.{name}``: the local block's
    consecutive ``sections`` along local axis ``dim``, each placed in its own global tensor like the whole was
    (rank ``r``'s piece at block ``r``). Loading concatenates the pieces."""
    if not isinstance(sharded, ShardedTensor):
        raise TypeError(f"split_tensor_factory needs a ShardedTensor, got {type(sharded).__name__}")
    if len(sections) != len(names) or sum(sections) != sharded.local_shape[dim]:
        raise ValueError(f"{sharded.key}: sections {sections} ({names}) must cover the local axis {dim} of size "
                         f"{sharded.local_shape[dim]}")
    template = sharded.without_data()

    @torch.no_grad()
    def build(key, tensor, replica_id, flattened_range):
        whole = dataclasses.replace(template, key=key, data=tensor, dtype=tensor.dtype, replica_id=replica_id)
        pieces, start = [], 0
        for size, name in zip(sections, names):
            pieces.extend(dataclasses.replace(piece, key=f"{key}.{name}") for piece in whole.narrow(dim, start, size))
            start += size
        return pieces

    def merge(pieces):
        with torch.no_grad():
            return torch.cat(pieces, dim=dim)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id,
                                flattened_range=sharded.flattened_range)


def _no_init(tensor):
    """in_proj is initialised by the mixer from the global [z; x; B; C; dt] weight (module docstring)."""
    return tensor


def _module_class(spec, default):
    if spec is None:
        return default
    return spec.module if isinstance(spec, ModuleSpec) else spec


__all__ = ["MambaMixer", "MambaMixerSubmodules", "MambaDims", "mamba_dims", "rank_rows", "split_tensor_factory"]
