"""megatron-core's hybrid Mamba language model (``MambaModel``; Megatron-LM HEAD calls it ``HybridModel``).

embedding (first stage) -> :class:`~megatron.core.ssm.mamba_block.MambaStack` (Mamba-2 / attention / MLP / MoE
layers from the hybrid pattern, ``decoder.final_norm`` on the last stage) -> ``output_layer`` (last stage).
Position embeddings default to ``'none'``; with ``'rope'`` the angles are computed once here and applied in the
attention layers. Checkpoint keys: ``embedding.word_embeddings.weight``, ``decoder.layers.{global i}.…``,
``decoder.final_norm.weight``, ``output_layer.weight``.
"""
from __future__ import annotations

from typing import Optional

from megatron.core import tensor_parallel
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.enums import ModelType
from megatron.core.models.common.embedding import LanguageModelEmbedding
from megatron.core.models.gpt.gpt_model import LanguageModule
from megatron.core.process_groups_config import pg_size
from megatron.core.ssm.mamba_block import MambaStack
from megatron.core.transformer.rotary import RotaryEmbedding
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


class MambaModel(LanguageModule):
    """``MambaModel(config, mamba_stack_spec, vocab_size, max_sequence_length, pre_process=True,
    hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0, hybrid_override_pattern=None, post_process=True,
    fp16_lm_cross_entropy=False, parallel_output=True, share_embeddings_and_output_weights=False,
    position_embedding_type='none', rotary_percent=1.0, rotary_base=10000, seq_len_interpolation_factor=None,
    vp_stage=None, pg_collection=None, *, hybrid_layer_pattern=None)``; the pattern defaults to
    ``config.hybrid_layer_pattern``; the collection's groups (``tp`` for the vocabulary and every layer, ``pp`` for the
    stage's layers, ``embd`` for tied weights; else parallel_state's) reach every module.

    ``forward(input_ids [b, s], position_ids [b, s], attention_mask, decoder_input=None, labels=None,
    inference_params=None)`` -> logits ``[b, s, V/tp]``, or the per-token loss ``[b, s]`` with ``labels``.
    """

    def __init__(self, config, mamba_stack_spec: ModuleSpec, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, hybrid_attention_ratio: float = 0.0, hybrid_mlp_ratio: float = 0.0,
                 hybrid_override_pattern: Optional[str] = None, post_process: bool = True,
                 fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False, position_embedding_type: str = "none",
                 rotary_percent: float = 1.0, rotary_base: int = 10000, seq_len_interpolation_factor=None,
                 vp_stage: Optional[int] = None, pg_collection=None, *, hybrid_layer_pattern: Optional[str] = None):
        super().__init__(config=config, pg_collection=pg_collection,
                         share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError("position_embedding_type must be 'learned_absolute', 'rope' or 'none', "
                             f"got {position_embedding_type!r}")
        hybrid_layer_pattern = hybrid_layer_pattern or hybrid_override_pattern or config.hybrid_layer_pattern
        if pg_size(pg_collection, "cp") > 1 and "M" in (hybrid_layer_pattern or "M"):
            raise NotImplementedError(f"MambaModel with a context-parallel group of {pg_size(pg_collection, 'cp')} "
                                      "ranks: context parallelism of the Mamba layers is not implemented in this "
                                      "library; use context parallel size 1")
        self.hybrid_layer_pattern = hybrid_layer_pattern
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.position_embedding_type = position_embedding_type
        self.model_type = ModelType.encoder_or_decoder

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                    position_embedding_type=position_embedding_type,
                                                    tp_group=self.tp_group)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, rotary_percent,
                                                  rotary_interleaved=config.rotary_interleaved,
                                                  seq_len_interpolation_factor=seq_len_interpolation_factor,
                                                  rotary_base=rotary_base)
        self.decoder = build_module(mamba_stack_spec, config, pre_process=pre_process,
                                    hybrid_attention_ratio=hybrid_attention_ratio, hybrid_mlp_ratio=hybrid_mlp_ratio,
                                    post_process=post_process,
                                    hybrid_layer_pattern=hybrid_layer_pattern, vp_stage=vp_stage,
                                    **({} if pg_collection is None else {"pg_collection": pg_collection}))
        if not isinstance(self.decoder, MambaStack):
            raise TypeError(f"mamba_stack_spec must build a MambaStack, got {type(self.decoder).__name__}")
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=False,
                skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
                tp_group=self.tp_group, reuse_cpu_output_buffer=True)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, list):
            if len(input_tensor) != 1:
                raise ValueError("input_tensor should only be length 1 for a hybrid model")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_params=None, **unused):
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_pos_emb = self.rotary_pos_emb(self._rotary_seq_len(input_ids, decoder_input, inference_params))
        hidden_states = self.decoder(decoder_input, attention_mask, inference_params=inference_params,
                                     rotary_pos_emb=rotary_pos_emb)
        if not self.post_process:
            return hidden_states
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=output_weight)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)
