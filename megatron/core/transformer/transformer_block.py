"""The stack of transformer layers of one pipeline stage (and virtual-pipeline chunk), with recompute.

``ParallelTransformer`` is Megatron's legacy class; megatron-core's ``TransformerBlock`` is the same class
built from a layer spec. Submodule names (``layers.{i}``, ``final_layernorm``) are the same in both APIs.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.enums import ModelType
from megatron.core.fp8_utils import is_first_last_bf16_layer
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.process_groups_config import group_of, pg_rank, pg_size
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import get_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.transformer.transformer_layer import (NoopTransformerLayer, ParallelTransformerLayer, TransformerLayer,
                                                         default_layer_submodules)
from megatron.core.utils import make_viewless_tensor


@dataclass
class TransformerBlockSubmodules:
    """megatron-core's block spec: one layer spec per global layer (e.g. dense and MoE layers mixed) and the final
    norm (``None``: no final norm)."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)
    layer_norm: Optional[Union[ModuleSpec, type]] = None


def _pp(pp_rank: Optional[int], pp_size: Optional[int]):
    """(rank, size) of the pipeline stage: the given ones, else parallel_state's."""
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_size > 1 else 0
    return pp_rank, pp_size


def _split_stages(role: Optional[str], pp: int):
    """(first stage, number of stages) of the pipeline stages holding ``role``'s layers: with a split rank the
    encoder of an encoder-decoder model lives on stages ``[0, split)`` and the decoder on ``[split, pp)``."""
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    if role is None or pp == 1 or split is None:
        return 0, pp
    if role == "encoder":
        return 0, split
    if role == "decoder":
        return split, pp - split
    raise ValueError(f"role must be None, 'encoder' or 'decoder', got {role!r}")


def get_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None, *,
                            pp_size: Optional[int] = None, standalone_embedding_stage: Optional[bool] = None,
                            role: Optional[str] = None) -> int:
    """Layers held by pipeline stage ``pp_rank`` of ``pp_size`` (default: parallel_state's) per virtual chunk:
    ``num_layers / pp [/ vpp]`` (megatron-core's signature; ``vp_stage`` does not change the even split).

    ``role`` ('encoder' / 'decoder'): the stack of an encoder-decoder model; with
    ``--pipeline-model-parallel-split-rank`` its layers are divided over its own stages only.
    """
    pp_rank, pp = _pp(pp_rank, pp_size)
    if standalone_embedding_stage is None:
        standalone_embedding_stage = bool(getattr(config, "standalone_embedding_stage", False))
    num_layers = config.num_layers
    first, stages = _split_stages(role, pp)
    if stages != pp:
        if standalone_embedding_stage:
            raise ValueError("--standalone-embedding-stage with --pipeline-model-parallel-split-rank is not supported")
        if stages <= 0:
            raise ValueError(f"the {role} has no pipeline stage: --pipeline-model-parallel-split-rank must be in "
                             f"[1, {pp - 1}] (--pipeline-model-parallel-size {pp})")
        if num_layers % stages != 0:
            flag = "--num-layers" if role == "encoder" else "--decoder-num-layers"
            raise ValueError(f"the {role}'s {num_layers} layers must be divisible by its {stages} pipeline stages; "
                             f"change {flag} or --pipeline-model-parallel-split-rank")
        return num_layers // stages
    if pp > 1:
        transformer_pp = pp - 1 if standalone_embedding_stage else pp
        if standalone_embedding_stage and pp_rank == 0:
            return 0
        if num_layers % transformer_pp != 0:
            raise ValueError(f"num_layers ({num_layers}) must be divisible by the number of pipeline stages that hold "
                             f"layers ({transformer_pp}); change --num-layers or --pipeline-model-parallel-size")
        num_layers //= transformer_pp
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None:
        if num_layers % vpp != 0:
            raise ValueError(f"layers per pipeline stage ({num_layers}) must be divisible by the virtual pipeline "
                             f"size ({vpp}); check --num-layers-per-virtual-pipeline-stage")
        num_layers //= vpp
    return num_layers


def get_layer_offset(config, num_layers_here: int, standalone_embedding_stage: bool = False,
                     role: Optional[str] = None, *, pp_rank: Optional[int] = None, pp_size: Optional[int] = None,
                     vp_stage: Optional[int] = None) -> int:
    """Global index of this chunk's first layer (within its stack).

    Without virtual stages: ``pp_rank * layers_per_stage``. With ``vpp`` chunks, chunk ``v`` of stage ``p``
    starts at ``v * (L / vpp) + p * layers_per_chunk`` (8 layers, pp 2, vpp 2: stage 0 holds [0,1] and
    [4,5], stage 1 holds [2,3] and [6,7]). A decoder after the split rank numbers its layers from 0 again.
    """
    pp_rank, pp = _pp(pp_rank, pp_size)
    first, stages = _split_stages(role, pp)
    if stages != pp:
        return (pp_rank - first) * num_layers_here
    if standalone_embedding_stage and pp > 1:
        pp_rank = max(pp_rank - 1, 0)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None:
        vp_rank = vp_stage if vp_stage is not None else (parallel_state.get_virtual_pipeline_model_parallel_rank() or 0)
        return vp_rank * (config.num_layers // vpp) + pp_rank * num_layers_here
    return pp_rank * num_layers_here


def _spec_of_layer(layer_specs, layer_number: int, offset: int, total_layers: int, local_layers: int):
    """The spec of global layer ``layer_number`` (1-based) in a block spec's ``layer_specs``, which lists either
    every layer of the model (our GPT specs) or only this stage's layers, from global index ``offset`` on (as
    megatron-core's sliced specs, e.g. the heterogeneous one, do)."""
    if len(layer_specs) == total_layers:
        return layer_specs[layer_number - 1]
    if len(layer_specs) == local_layers:
        return layer_specs[layer_number - 1 - offset]
    raise ValueError(f"the block spec lists {len(layer_specs)} layer specs; expected one per layer of the model "
                     f"({total_layers}) or of this pipeline stage ({local_layers})")


class ParallelTransformer(MegatronModule):
    """``ParallelTransformer(config, model_type, layer_type, self_attn_mask_type, post_layer_norm, pre_process,
    post_process, drop_path_rate)``; ``forward(hidden_states, attention_mask, encoder_output=None,
    enc_dec_attn_mask=None, ..., inference_params=None, rotary_pos_emb=None) -> hidden_states``.

    On stages other than the first the input comes from :meth:`set_input_tensor` (the pipeline schedule).
    """

    def __init__(self, config, model_type=ModelType.encoder_or_decoder, layer_type=LayerType.encoder,
                 self_attn_mask_type=AttnMaskType.padding, post_layer_norm=True, pre_process=True,
                 post_process=True, drop_path_rate=0.0, *, layer_spec=None, pg_collection=None, vp_stage=None):
        super().__init__(config=config)
        # megatron-core's pg_collection reaches every spec-built layer; its pp group places the layers.
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        # The two stacks of an encoder-decoder model divide the pipeline at the split rank.
        role = None
        if model_type == ModelType.encoder_and_decoder:
            role = "decoder" if layer_type == LayerType.decoder else "encoder"
        if config.transformer_impl == "transformer_engine":
            from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

            transformer_engine_layers_unavailable()
        self.layer_type = layer_type
        self.model_type = model_type
        self.post_layer_norm = post_layer_norm
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor = None
        self.drop_path_rate = drop_path_rate
        self.sequence_parallel = config.sequence_parallel
        self.recompute_granularity = config.recompute_granularity
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers
        self.distribute_saved_activations = bool(config.distribute_saved_activations) and not config.sequence_parallel

        standalone = config.standalone_embedding_stage
        pp = dict(pp_rank=pg_rank(pg_collection, "pp"), pp_size=pg_size(pg_collection, "pp"))
        self.num_layers = get_num_layers_to_build(config, standalone_embedding_stage=standalone, role=role, **pp)
        offset = get_layer_offset(config, self.num_layers, standalone, role, vp_stage=vp_stage, **pp)
        self.drop_path_rates = [rate.item() for rate in torch.linspace(0, drop_path_rate, max(config.num_layers, 1))]

        groups = {} if pg_collection is None else {"pg_collection": pg_collection}

        def build_layer(layer_number):
            # A heterogeneous config (Nemotron-NAS) gives each global layer its own config.
            layer_config = (config.get_config_for_layer(layer_number)
                            if getattr(config, "heterogeneous_block_specs", False) else config)
            if getattr(config, "fp8", None) and is_first_last_bf16_layer(config, layer_number - 1):
                layer_config = dataclasses.replace(layer_config, fp8=None)  # --first-last-layers-bf16
            if isinstance(layer_spec, TransformerBlockSubmodules):
                return build_module(_spec_of_layer(layer_spec.layer_specs, layer_number, offset, config.num_layers,
                                                   self.num_layers), config=layer_config,
                                    layer_number=layer_number, **groups)
            if layer_spec is not None:
                return build_module(layer_spec, config=layer_config, layer_number=layer_number, **groups)
            return ParallelTransformerLayer(config, layer_number, layer_type=layer_type,
                                            self_attn_mask_type=self_attn_mask_type,
                                            drop_path_rate=self.drop_path_rates[layer_number - 1])

        if self.num_layers == 0:
            # A stage without layers must still return a tensor that is not its input (see NoopTransformerLayer).
            self.num_layers = 1
            self.layers = torch.nn.ModuleList([NoopTransformerLayer(1)])
        else:
            self.layers = torch.nn.ModuleList([build_layer(i + 1 + offset) for i in range(self.num_layers)])

        if self.post_process and self.post_layer_norm:
            self.final_layernorm = get_norm(config)

    def _non_homogeneous_layers(self, metadata) -> bool:
        """Whether the layers are saved one key per layer (``layers.{i}.``) instead of stacked: megatron-core's rule
        (metadata ``non_homogeneous_layers`` / ``singleton_local_shards``, or a layer pattern in the config)."""
        metadata = metadata or {}
        if metadata.get("non_homogeneous_layers") or metadata.get("singleton_local_shards"):
            return True
        config = self.config
        for name in ("moe_layer_freq", "linear_attention_freq"):
            freq = getattr(config, name, None)
            if isinstance(freq, (list, tuple)) or (isinstance(freq, int) and freq > 1 and
                                                    (name != "moe_layer_freq" or config.num_moe_experts)):
                return True
        return bool(getattr(config, "heterogeneous_block_specs", False)
                    or getattr(config, "hetereogenous_dist_checkpoint", False))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """Layer ``i`` (global index ``layer_number - 1`` within this stack of ``config.num_layers``) is stored
        stacked: its tensors get the prepended offset ``(0, i, L)`` and keys ``{prefix}layers.<name>``, so the
        checkpoint does not depend on PP / VPP; per-layer keys ``{prefix}layers.{i}.<name>`` for
        non-homogeneous stacks (:meth:`_non_homogeneous_layers`). Then the final norm and other children."""
        if sharded_offsets:
            raise ValueError("a transformer block takes no sharded_offsets (its layers add the layer axis)")
        per_layer = self._non_homogeneous_layers(metadata)
        num_layers = self.config.num_layers
        out = {}
        for index, layer in enumerate(self.layers):
            if isinstance(layer, NoopTransformerLayer):
                continue
            global_index = layer.layer_number - 1
            local_prefix = f"{prefix}layers.{index}."
            if per_layer:
                layer_sd = layer.sharded_state_dict(local_prefix, (), metadata)
                replace_prefix_for_sharding(layer_sd, local_prefix, f"{prefix}layers.{global_index}.")
            else:
                layer_sd = layer.sharded_state_dict(local_prefix, ((0, global_index, num_layers),), metadata)
                replace_prefix_for_sharding(layer_sd, local_prefix, f"{prefix}layers.")
            out.update(layer_sd)
        for name, module in self.named_children():
            if module is not self.layers:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", (), metadata,
                                                      tp_group=getattr(self, "tp_group", None)))
        return out

    def _get_layer(self, layer_number):
        return self.layers[layer_number]

    def set_input_tensor(self, input_tensor):
        """The activation received from the previous pipeline stage (used instead of forward's input)."""
        self.input_tensor = input_tensor

    @staticmethod
    def _run_layer(layer, hidden_states, attention_mask, encoder_output, enc_dec_attn_mask, inference_params,
                   rotary_pos_emb, packed_seq_params=None):
        if isinstance(layer, TransformerLayer):
            packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
            hidden_states, _ = layer(hidden_states, attention_mask, context=encoder_output,
                                     context_mask=enc_dec_attn_mask, rotary_pos_emb=rotary_pos_emb,
                                     inference_params=inference_params, **packed)
            return hidden_states
        if packed_seq_params is not None:
            raise NotImplementedError(f"packed sequences (packed_seq_params) are not supported by "
                                      f"{type(layer).__name__} layers (only megatron-core TransformerLayer)")
        return layer(hidden_states, attention_mask, encoder_output=encoder_output,
                     enc_dec_attn_mask=enc_dec_attn_mask, inference_params=inference_params,
                     rotary_pos_emb=rotary_pos_emb)

    def _checkpointed_forward(self, hidden_states, attention_mask, encoder_output, enc_dec_attn_mask,
                              rotary_pos_emb, packed_seq_params=None):
        """Full recompute: only the inputs of each recomputed chunk of layers are kept for backward."""

        def custom(start, end):
            def custom_forward(x_, mask, enc_out, enc_dec_mask, rope):
                for index in range(start, end):
                    x_ = self._run_layer(self._get_layer(index), x_, mask, enc_out, enc_dec_mask, None, rope,
                                         packed_seq_params)
                return x_

            return custom_forward

        n = self.recompute_num_layers
        args = (attention_mask, encoder_output, enc_dec_attn_mask, rotary_pos_emb)
        if self.recompute_method == "uniform":
            # Checkpoint every n consecutive layers: fewest stored activations, one extra forward overall.
            layer = 0
            while layer < self.num_layers:
                end = min(layer + n, self.num_layers)
                hidden_states = tensor_parallel.checkpoint(custom(layer, end), self.distribute_saved_activations,
                                                           hidden_states, *args)
                layer = end
        elif self.recompute_method == "block":
            # Checkpoint only the first n layers of the stage; the rest keep their activations.
            for layer in range(self.num_layers):
                if layer < n:
                    hidden_states = tensor_parallel.checkpoint(custom(layer, layer + 1),
                                                               self.distribute_saved_activations, hidden_states, *args)
                else:
                    hidden_states = custom(layer, layer + 1)(hidden_states, *args)
        else:
            raise ValueError(f"invalid recompute_method {self.recompute_method!r} (--recompute-method uniform|block)")
        return hidden_states

    def forward(self, hidden_states, attention_mask, encoder_output=None, enc_dec_attn_mask=None,
                retriever_input=None, retriever_output=None, retriever_attn_mask=None, inference_params=None,
                rotary_pos_emb=None, packed_seq_params=None):
        if not self.pre_process:
            hidden_states = self.input_tensor
        # Viewless so that the pipeline schedule can free it after sending (see make_viewless_tensor).
        hidden_states = make_viewless_tensor(hidden_states, requires_grad=True, keep_graph=True)

        # With sequence parallelism every TP rank holds different tokens: hidden dropout must differ per rank.
        rng_context = (tensor_parallel.get_cuda_rng_tracker().fork() if self.sequence_parallel
                       else contextlib.nullcontext())
        with rng_context:
            if self.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(hidden_states, attention_mask, encoder_output,
                                                           enc_dec_attn_mask, rotary_pos_emb, packed_seq_params)
            else:
                for layer in self.layers:
                    hidden_states = self._run_layer(layer, hidden_states, attention_mask, encoder_output,
                                                    enc_dec_attn_mask, inference_params, rotary_pos_emb,
                                                    packed_seq_params)

        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


class TransformerBlock(ParallelTransformer):
    """megatron-core: ``TransformerBlock(config, spec, post_layer_norm=True, pre_process=True, post_process=True)``;
    ``forward(hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
    inference_params=None)``. ``spec`` is a layer ``ModuleSpec`` (e.g. ``get_gpt_layer_local_spec()``) or a
    :class:`TransformerBlockSubmodules` (its layers must share one spec; its ``layer_norm`` decides the final
    norm). ``role`` ('encoder' / 'decoder', keyword): the stack of an encoder-decoder model, whose layers are
    divided over the stages before / after ``--pipeline-model-parallel-split-rank``."""

    def __init__(self, config, spec: ModuleSpec = None, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None, vp_stage: Optional[int] = None, *,
                 role: Optional[str] = None):
        if spec is None:  # the local causal layer (what get_gpt_layer_local_spec() builds)
            spec = ModuleSpec(module=TransformerLayer, submodules=default_layer_submodules(AttnMaskType.causal))
        if isinstance(spec, TransformerBlockSubmodules):
            post_layer_norm = post_layer_norm and spec.layer_norm is not None
            if all(layer_spec is spec.layer_specs[0] for layer_spec in spec.layer_specs):
                spec = spec.layer_specs[0]  # one spec for every layer; else each layer builds its own
        model_type, layer_type = ModelType.encoder_or_decoder, LayerType.encoder
        if role is not None:
            model_type = ModelType.encoder_and_decoder
            layer_type = LayerType.decoder if role == "decoder" else LayerType.encoder
        if vp_stage is not None and vp_stage != (parallel_state.get_virtual_pipeline_model_parallel_rank() or 0):
            raise ValueError(f"TransformerBlock(vp_stage={vp_stage}): the virtual pipeline rank set in parallel_state "
                             f"is {parallel_state.get_virtual_pipeline_model_parallel_rank()}; set it to the chunk "
                             "being built (parallel_state.set_virtual_pipeline_model_parallel_rank)")
        super().__init__(config, model_type=model_type, layer_type=layer_type, post_layer_norm=post_layer_norm,
                         pre_process=pre_process, post_process=post_process, layer_spec=spec,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.vp_stage = vp_stage
        # megatron-core's attributes: layers per pipeline rank (of the whole model, not this chunk) and whether
        # selective recompute checkpoints the core attention.
        self.num_layers_per_pipeline_rank = config.num_layers // pg_size(pg_collection, "pp")
        self.checkpoint_core_attention = config.recomputes("core_attn")

    def forward(self, hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
                inference_params=None, packed_seq_params=None):
        return super().forward(hidden_states, attention_mask, encoder_output=context, enc_dec_attn_mask=context_mask,
                               inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
                               packed_seq_params=packed_seq_params)
