"""MegatronModule (word embeddings tied across the first and last pipeline stage) and Float16Module."""
from __future__ import annotations

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import is_pp_first_stage_of, is_pp_last_stage_of
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, own_and_children_sharded_state_dict

_FLOAT_TYPES = (torch.float32,)
_HALF_TYPES = (torch.float16,)
_BF16_TYPES = (torch.bfloat16,)


def param_is_not_shared(param) -> bool:
    return not getattr(param, "shared", False)


def is_member(group) -> bool:
    """Whether this rank belongs to ``group`` (a group made by ``new_group`` on every rank is a placeholder on the
    others)."""
    return group is not None and group is not torch.distributed.GroupMember.NON_GROUP_MEMBER


def sync_tied_weight_across_pipeline(weight: torch.Tensor, is_copy: bool, embd_group=None) -> None:
    """Make the last stage's copy of the tied embedding equal to the first stage's.

    The copy (``is_copy``) starts at zero, so an all-reduce (sum) over the embedding group — the first and
    last stage of each pipeline; ``embd_group`` (a pg_collection's ``embd``) or parallel_state's — gives both
    stages the first stage's values.
    """
    if is_copy:
        with torch.no_grad():
            weight.data.fill_(0)
        weight.shared = True
        weight.shared_embedding = True
    if not torch.distributed.is_initialized():
        return
    if embd_group is not None:
        if is_member(embd_group):
            torch.distributed.all_reduce(weight.data, group=embd_group)
        return
    if parallel_state.is_rank_in_embedding_group():
        torch.distributed.all_reduce(weight.data, group=parallel_state.get_embedding_group())


# Older and newer Megatron checkpoints spell a few submodules differently; loading maps them onto ours.
_LEGACY_KEY_RENAMES = (
    (".input_norm.", ".input_layernorm."),
    (".post_attention_norm.", ".post_attention_layernorm."),
    (".post_inter_attention_norm.", ".post_inter_attention_layernorm."),
    ("final_norm.", "final_layernorm."),
    (".attention.", ".self_attention."),
)


def flatten_checkpoint_state_dict(state_dict, prefix: str = "") -> dict:
    """Megatron's nested checkpoint dicts (``{'language_model': {'embedding': {...}}}``) to flat module keys.

    ``word_embeddings_for_head`` (the last stage's tied copy) is the ``word_embeddings`` module of the model.
    A flat state dict is returned unchanged.
    """
    flat = {}
    for key, value in state_dict.items():
        name = "word_embeddings" if key == "word_embeddings_for_head" else key
        if isinstance(value, dict):
            flat.update(flatten_checkpoint_state_dict(value, prefix + name + "."))
        else:
            flat[prefix + name] = value
    return flat


class MegatronModule(torch.nn.Module):
    """Base of every Megatron model: checkpoint state dict hook and the pipeline-tied word embeddings.

    ``MegatronModule(config=None, share_embeddings_and_output_weights=True)``. Models that tie the output layer
    to the input embedding call :meth:`initialize_word_embeddings` after building their submodules: with
    pipeline parallelism the last stage, which has no embedding, gets a zero-initialised copy
    (``word_embeddings``, saved as ``word_embeddings_for_head``) that an all-reduce over the embedding group
    makes equal to the first stage's table; the gradients of both copies are all-reduced the same way
    after every backward pass (by the optimizer), so they stay equal.
    """

    def __init__(self, config=None, share_embeddings_and_output_weights: bool = True):
        super().__init__()
        self.config = config
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The state dict that goes into checkpoints (models override this to nest it like Megatron)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """This module's checkpoint state as sharded leaves (megatron-core's contract): its own parameters and
        persistent buffers replicated over TP and DP (a parameter marked tensor-parallel split along its
        ``partition_dim``), then every child's ``sharded_state_dict`` under ``prefix + name + '.'`` with the same
        ``sharded_offsets`` (modules without one: :func:`sharded_state_dict_default`). Dict keys are this module's
        state-dict names; each leaf's ``key`` is the global checkpoint key."""
        return own_and_children_sharded_state_dict(self, prefix, sharded_offsets,
                                                   ensure_metadata_has_dp_cp_group(metadata),
                                                   getattr(self, "tp_group", None))

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a flat state dict or Megatron's nested checkpoint layout (see flatten_checkpoint_state_dict).
        ``_extra_state`` entries this model does not have (megatron-core's linear layers carry an empty one) are
        skipped."""
        flat = flatten_checkpoint_state_dict(state_dict)
        expected = set(self.state_dict().keys())
        fixed = {}
        for key, value in flat.items():
            if key.endswith("._extra_state") and key not in expected:
                continue
            if key not in expected:
                for old, new in _LEGACY_KEY_RENAMES:
                    renamed = ("." + key).replace(old, new)[1:]
                    if renamed in expected:
                        key = renamed
                        break
            fixed[key] = value
        return super().load_state_dict(fixed, strict=strict)

    def shared_embedding_or_output_weight(self):
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if not self.share_embeddings_and_output_weights:
            raise Exception("shared_embedding_or_output_weight() called for last stage, but "
                            "share_embeddings_and_output_weights is false")
        return self.word_embeddings.weight

    def initialize_word_embeddings(self):
        if not self.share_embeddings_and_output_weights:
            raise Exception("initialize_word_embeddings() was called but share_embeddings_and_output_weights is false")
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return

        if parallel_state.is_pipeline_first_stage() and self.pre_process and not self.post_process:
            self.shared_embedding_or_output_weight().shared_embedding = True

        is_copy = False
        if parallel_state.is_pipeline_last_stage() and not self.pre_process:
            assert not parallel_state.is_pipeline_first_stage()
            self._word_embeddings_for_head_key = "word_embeddings_for_head"
            self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                self.config.required_padded_vocab_size(),
                self.config.hidden_size, config=self.config, init_method=self.config.init_method)
            is_copy = True

        # A pre-process stage that is not the first pipeline stage (the decoder's embedding of an
        # encoder-decoder model) receives its values from the first stage through the all-reduce too.
        if not parallel_state.is_pipeline_first_stage(ignore_virtual=True) and self.pre_process:
            self.language_model.embedding.zero_parameters()

        if self.pre_process or is_copy:
            sync_tied_weight_across_pipeline(self.shared_embedding_or_output_weight(), is_copy)

        if (parallel_state.is_rank_in_position_embedding_group()
                and parallel_state.get_pipeline_model_parallel_split_rank() is not None
                and self.pre_process and hasattr(self.language_model.embedding, "position_embeddings")):
            position_embeddings = self.language_model.embedding.position_embeddings
            torch.distributed.all_reduce(position_embeddings.weight.data,
                                         group=parallel_state.get_position_embedding_group())


class GraphableMegatronModule(MegatronModule):
    """megatron-core's base of the layers that CUDA graphs can capture (TransformerLayer, MambaLayer):
    ``GraphableMegatronModule(config, vp_stage=None)``.

    CUDA graphs (``--cuda-graph-impl local / transformer_engine``) are not part of this library, so the module is a
    :class:`MegatronModule` whose call is the plain forward, plus megatron-core's graph-independent helpers:
    :meth:`get_layer_static_inputs` (the ``hidden_states`` a capture would use) and :meth:`setup_manual_hooks`
    (one hook per submodule that holds parameters directly, as a replayed graph would need them called)."""

    def __init__(self, config, vp_stage=None):
        super().__init__(config=config)
        self.cuda_graphs = []
        self.cuda_graph_manual_hooks = []

    def get_layer_static_inputs(self, seq_length, micro_batch_size):
        """``{"hidden_states": ones[s, micro_batch_size, hidden]}`` in bf16 with ``requires_grad``, where ``s`` is
        ``seq_length / context_parallel_size``, further divided by the TP size under sequence parallelism."""
        config = self.config
        seq = seq_length // config.context_parallel_size
        if config.sequence_parallel:
            seq //= config.tensor_model_parallel_size
        from megatron.core import device

        hidden = torch.ones((seq, micro_batch_size, config.hidden_size), dtype=torch.bfloat16, requires_grad=True,
                            device=device.current_device())
        return {"hidden_states": hidden}

    def setup_manual_hooks(self, make_hook_func):
        """``cuda_graph_manual_hooks = [(make_hook_func(), (module,))]`` for every module (once each) under
        :meth:`_get_submodules_under_cudagraphs` that holds a parameter of its own."""
        owners = {}
        for submodule in self._get_submodules_under_cudagraphs():
            for module in submodule.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    owners[id(module)] = module
        self.cuda_graph_manual_hooks = [(make_hook_func(), (module,)) for module in owners.values()]

    def _get_submodules_under_cudagraphs(self):
        """The submodules a graph would cover: the whole layer."""
        return [self]


def conversion_helper(val, conversion):
    """Apply ``conversion`` to every leaf of nested tuples/lists."""
    if not isinstance(val, (tuple, list)):
        return conversion(val)
    rtn = [conversion_helper(v, conversion) for v in val]
    if isinstance(val, tuple):
        rtn = tuple(rtn)
    return rtn


def fp32_to_float16(val, float16_convertor):
    def half_conversion(val):
        if torch.is_tensor(val) and val.dtype in _FLOAT_TYPES:
            return float16_convertor(val)
        return val

    return conversion_helper(val, half_conversion)


def float16_to_fp32(val):
    def float_conversion(val):
        if torch.is_tensor(val) and val.dtype in _HALF_TYPES + _BF16_TYPES:
            return val.float()
        return val

    return conversion_helper(val, float_conversion)


class Float16Module(MegatronModule):
    """Run ``module`` in fp16 or bf16: cast its parameters, cast fp32 inputs on the first pipeline stage
    and cast outputs back to fp32 on the last. megatron-core signature ``Float16Module(config, module)``."""

    def __init__(self, config, module: torch.nn.Module):
        super().__init__(config)
        if config.fp16:
            self.add_module("module", module.half())
            self.float16_convertor = lambda val: val.half()
        elif config.bf16:
            self.add_module("module", module.bfloat16())
            self.float16_convertor = lambda val: val.bfloat16()
        else:
            raise Exception("should not be here: Float16Module needs fp16 or bf16 (--fp16 / --bf16)")

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, **kwargs):
        # The stage comes from the wrapped model's pg_collection (megatron-core's), else parallel_state.
        groups = getattr(self.module, "pg_collection", None)
        if is_pp_first_stage_of(groups):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if is_pp_last_stage_of(groups):
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", *args, **kwargs):
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict=strict)
