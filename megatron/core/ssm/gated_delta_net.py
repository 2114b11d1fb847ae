"""Gated DeltaNet (GDN; Qwen3-Next's linear attention): megatron-core's ``GatedDeltaNet`` in pure PyTorch,
tensor-parallel as Megatron splits it.

Sizes: ``n_k`` key heads and ``n_v`` value heads (``linear_num_key_heads`` / ``linear_num_value_heads``, ``n_v`` a
multiple of ``n_k``) of widths ``d_k`` / ``d_v``, conv kernel ``K`` (``linear_conv_kernel_dim``). On each of ``t``
tensor-parallel ranks the layer holds ``n_k/t`` key and ``n_v/t`` value heads. For ``u [s, b, h]`` (already
normalised by the layer's pre-norm):

1. ``in_proj`` (column parallel) gives, per rank, ``[q | k | v | z | beta | alpha]`` of sizes ``n_k d_k/t, n_k d_k/t,
   n_v d_v/t, n_v d_v/t, n_v/t, n_v/t`` (the global weight is ``[q; k; v; z; beta; alpha]`` and rank ``r`` holds the
   ``r``-th slice of each block);
2. ``[q, k, v] = act(causal depthwise conv1d([q, k, v]))`` (``act`` = ``config.activation_func``, SiLU for
   Qwen3-Next); ``q, k`` L2-normalised per head (``x / sqrt(|x|^2 + 1e-6)``), then repeated to the value heads (value
   head ``j`` reads key head ``j // (n_v/n_k)``);
3. ``a_t = exp(g_t)`` with ``g_t = -exp(A_log) softplus(alpha_t + dt_bias)``, ``beta_t = sigmoid(beta_t)``;
4. the gated delta rule per value head, state ``S [d_k, d_v]`` from zero, queries scaled by ``1/sqrt(d_k)``:
   ``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``;
5. ``y = out_norm(o) * act(z)`` per value head (``out_norm`` over ``d_v`` channels, ``config.normalization``);
6. ``out_proj`` (row parallel): ``(output, bias)``.

Step 4 runs in chunks of ``C`` tokens (WY form): within a chunk with ``G_i = exp(sum_{j<=i} g_j)`` and the chunk's
start state ``S0``, ``S_i = G_i S0 + sum_{j<=i} (G_i/G_j) k_j u_j^T`` where the corrected values solve the unit
lower-triangular system ``u_i + beta_i sum_{j<i} (G_i/G_j)(k_i.k_j) u_j = beta_i (v_i - G_i S0^T k_i)``; then
``o_i = G_i S0^T q_i + sum_{j<=i} (G_i/G_j)(q_i.k_j) u_j`` and the next chunk starts from ``S_C``. The fla / causal_conv1d
kernels megatron-core calls on GPUs compute the same.

Initialisation (global tensors drawn, then sliced: every TP size starts from the same model): ``in_proj`` /
``out_proj`` from the config's init methods, the conv like ``nn.Conv1d`` (uniform +-1/sqrt(K); +-``conv_init`` when
given), ``dt_bias = 1``, ``A ~ U(A_init_range)``, ``A_log = ln A``. The checkpoint stores ``in_proj.weight`` as the six
global tensors ``.{query,key,value,z,beta,alpha}`` and the conv as ``.{query,key,value}`` (megatron-core's keys): it does
not depend on TP. ``out_norm``'s weight is shared by the value heads the TP ranks split, so its gradient is summed over
TP. Packed sequences, inference caches and context parallelism are refused (as in megatron-core).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import group_of, pg_rank, pg_size
from megatron.core.ssm.mamba_mixer import rank_rows, split_tensor_factory
from megatron.core.ssm.ssd_chunked_scan import causal_depthwise_conv1d
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import get_norm, weights_on_meta
from megatron.core.transformer.spec_utils import IdentityOp, ModuleSpec, build_module

__all__ = ["GatedDeltaNetSubmodules", "GatedDeltaNet", "l2norm", "chunk_gated_delta_rule"]


@dataclass
class GatedDeltaNetSubmodules:
    """``in_proj`` (column parallel), ``out_norm`` (over ``d_v``), ``out_proj`` (row parallel); None or IdentityOp:
    this library's default."""

    in_proj: Union[ModuleSpec, type] = None
    out_norm: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` along ``dim``."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False):
    """The gated delta rule (module docstring, step 4) on ``query, key [b, s, H, d_k]``, ``value [b, s, H, d_v]``,
    ``g, beta [b, s, H]``: ``(output [b, s, H, d_v], final state [b, H, d_k, d_v] or None)``, fp32 math."""
    dtype = query.dtype
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (query, key, value, g, beta))  # [b, H, s, ...]
    b, h, s, d_k = k.shape
    d_v = v.shape[-1]
    q = q * d_k ** -0.5
    pad = (-s) % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n, c = (s + pad) // chunk_size, chunk_size
    q, k, v = (t.reshape(b, h, n, c, -1) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    gamma = g.cumsum(-1)                                                  # log G_i within each chunk
    inclusive = torch.tril(torch.ones(c, c, dtype=torch.bool, device=q.device))
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~inclusive, float("-inf")).exp()  # G_i/G_j, j<=i
    strict = decay.tril(-1)                                                                             # j < i
    system = torch.eye(c, device=q.device) + beta[..., :, None] * (k @ k.transpose(-1, -2)) * strict
    rhs = torch.cat([beta[..., None] * v, (beta * gamma.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_values, u_state = solved[..., :d_v], solved[..., d_v:]               # u = u_values - u_state @ S0
    state = (torch.zeros(b, h, d_k, d_v, device=q.device) if initial_state is None
             else initial_state.float())
    intra = (q @ k.transpose(-1, -2)) * decay
    outputs = []
    for i in range(n):
        u = u_values[:, :, i] - u_state[:, :, i] @ state
        outputs.append((q[:, :, i] * gamma[:, :, i, :, None].exp()) @ state + intra[:, :, i] @ u)
        tail = (gamma[:, :, i, -1:] - gamma[:, :, i]).exp()[..., None]     # G_C / G_j
        state = state * gamma[:, :, i, -1, None, None].exp() + (k[:, :, i] * tail).transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).reshape(b, h, n * c, d_v)[:, :, :s].transpose(1, 2).to(dtype)
    return out, (state if output_final_state else None)


def _parts(n_k: int, n_v: int, d_k: int, d_v: int) -> List[Tuple[str, int]]:
    """Global row blocks of ``in_proj.weight`` in order."""
    return [("query", n_k * d_k), ("key", n_k * d_k), ("value", n_v * d_v), ("z", n_v * d_v), ("beta", n_v),
            ("alpha", n_v)]


def _module(spec, default, *args, **kwargs):
    return build_module(default if spec is None or spec is IdentityOp else spec, *args, **kwargs)


class GatedDeltaNet(MegatronModule):
    """``GatedDeltaNet(config, submodules, layer_number=None, bias=False, conv_bias=False, conv_init=None,
    use_qk_l2norm=True, A_init_range=(1, 16), pg_collection=None)``; ``forward(hidden_states [s, b, h],
    attention_mask, ...) -> (output [s, b, h], bias)`` (module docstring). The collection's ``tp`` group (else
    parallel_state's) splits the heads."""

    def __init__(self, config, submodules: GatedDeltaNetSubmodules = None, layer_number: int = None,
                 bias: bool = False, conv_bias: bool = False, conv_init: Optional[float] = None,
                 use_qk_l2norm: bool = True, A_init_range: Tuple[float, float] = (1, 16), pg_collection=None):
        super().__init__(config=config)
        sub = submodules if submodules is not None else GatedDeltaNetSubmodules()
        if not (0 <= A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"A_init_range must be 0 <= low <= high, got {A_init_range}")
        self.layer_number, self.bias, self.conv_bias, self.conv_init = layer_number, bias, conv_bias, conv_init
        self.use_qk_l2norm, self.A_init_range = use_qk_l2norm, A_init_range
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        tp = pg_size(pg_collection, "tp")
        self.hidden_size = config.hidden_size
        self.act_fn = config.activation_func
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")
        if self.num_key_heads % tp:
            raise ValueError(f"linear_num_key_heads ({self.num_key_heads}) must be divisible by the tensor-parallel "
                             f"size ({tp})")
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.parts = _parts(self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim)
        self.in_proj_dim = sum(size for _, size in self.parts)
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        self.tp_size = tp
        groups = {} if self.tp_group is None else {"tp_group": self.tp_group}
        self.in_proj = _module(sub.in_proj, tensor_parallel.ColumnParallelLinear, self.hidden_size, self.in_proj_dim,
                               config=config, init_method=lambda w: w, bias=bias, gather_output=False,
                               skip_bias_add=False, **groups)
        device = self.in_proj.weight.device
        local_conv = self.conv_dim // tp
        self.conv1d = torch.nn.utils.skip_init(torch.nn.Conv1d, local_conv, local_conv, self.conv_kernel_dim,
                                               groups=local_conv, padding=self.conv_kernel_dim - 1, bias=conv_bias,
                                               dtype=config.params_dtype, device=device)
        heads = self.num_value_heads // tp
        self.dt_bias = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype, device=device))
        self.A_log = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype, device=device))
        for param in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log):
            if param is not None:
                set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.out_norm = (get_norm(config, hidden_size=self.value_head_dim) if sub.out_norm in (None, IdentityOp)
                         else build_module(sub.out_norm, config=config, hidden_size=self.value_head_dim,
                                           eps=config.layernorm_epsilon))
        if tp > 1:
            for param in self.out_norm.parameters():
                param.sequence_parallel = True   # shared by the value heads the TP ranks split: summed over TP
        self.out_proj = _module(sub.out_proj, tensor_parallel.RowParallelLinear, self.v_dim, self.hidden_size,
                                config=config, init_method=config.output_layer_init_method, bias=bias,
                                input_is_parallel=True, skip_bias_add=True, **groups)
        self._initialize()

    def reset_parameters(self):
        """The submodules' draws, then the layer's."""
        self.out_proj.reset_parameters()
        self._initialize()

    @torch.no_grad()
    def _initialize(self):
        if weights_on_meta(self) or not self.config.perform_initialization:
            return
        tp, rank = self.tp_size, pg_rank(self.pg_collection, "tp")
        weight = torch.empty(self.in_proj_dim, self.hidden_size, dtype=torch.float32)
        self.config.init_method(weight)
        self.in_proj.weight.copy_(weight[rank_rows(self.parts, tp, rank)])
        if self.in_proj.bias is not None:
            self.in_proj.bias.zero_()
        bound = self.conv_init if self.conv_init is not None else 1.0 / math.sqrt(self.conv_kernel_dim)
        conv_parts = self.parts[:3]
        conv = torch.empty(self.conv_dim, 1, self.conv_kernel_dim).uniform_(-bound, bound)
        channels = rank_rows(conv_parts, tp, rank)
        self.conv1d.weight.copy_(conv[channels])
        if self.conv1d.bias is not None:
            self.conv1d.bias.copy_(torch.empty(self.conv_dim).uniform_(-bound, bound)[channels])
        heads = slice(rank * self.dt_bias.numel(), (rank + 1) * self.dt_bias.numel())
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.log(torch.empty(self.num_value_heads).uniform_(*self.A_init_range))[heads])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The default (``A_log``, ``dt_bias``, the conv split over TP on axis 0, ``in_proj`` on axis 0, ``out_proj``
        on axis 1, ``out_norm`` replicated), with ``in_proj.weight`` as ``.{query,key,value,z,beta,alpha}`` and the
        conv as ``.{query,key,value}`` (megatron-core's keys; the checkpoint does not depend on TP)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        tp = self.tp_size
        names = [name for name, _ in self.parts]
        local = [size // tp for _, size in self.parts]
        out[f"{prefix}in_proj.weight"] = split_tensor_factory(out[f"{prefix}in_proj.weight"], local, names, 0)
        if f"{prefix}in_proj.bias" in out:
            out[f"{prefix}in_proj.bias"] = split_tensor_factory(out[f"{prefix}in_proj.bias"], local, names, 0)
        for name in ("conv1d.weight", "conv1d.bias"):
            if f"{prefix}{name}" in out:
                out[f"{prefix}{name}"] = split_tensor_factory(out[f"{prefix}{name}"], local[:3], names[:3], 0)
        return out

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor = None, key_value_states=None,
                inference_context=None, attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("GatedDeltaNet does not support inference caches")
        if packed_seq_params is not None:
            raise NotImplementedError("GatedDeltaNet does not support packed sequences")
        projected, _ = self.in_proj(hidden_states)                        # [s, b, local rows]
        s, b = projected.shape[:2]
        tp = self.tp_size
        q, k, v, z, beta, alpha = torch.split(projected.transpose(0, 1), [size // tp for _, size in self.parts], -1)
        qkv = causal_depthwise_conv1d(torch.cat([q, k, v], -1).transpose(1, 2), self.conv1d.weight, self.conv1d.bias)
        qkv = self.act_fn(qkv).transpose(1, 2)                             # [b, s, channels]
        q, k, v = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], -1)
        q = q.reshape(b, s, -1, self.key_head_dim)
        k = k.reshape(b, s, -1, self.key_head_dim)
        v = v.reshape(b, s, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            q, k = l2norm(q.float()), l2norm(k.float())
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta.float().sigmoid())
        y = self.out_norm(o.to(hidden_states.dtype)).float() * self.act_fn(z.reshape(b, s, -1, self.value_head_dim)
                                                                           .float())
        y = y.to(hidden_states.dtype).reshape(b, s, -1).transpose(0, 1).contiguous()
        return self.out_proj(y)
