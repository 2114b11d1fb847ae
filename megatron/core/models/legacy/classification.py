"""Megatron's legacy finetuning heads over the BERT encoder: ``Classification`` (GLUE) and ``MultipleChoice`` (RACE).

Both run the BERT language model (embedding with token types -> pre-LN encoder -> pooler ``tanh(W h_[CLS] + b)``)
and put one replicated linear layer on the pooled output after dropout (``config.hidden_dropout``):

* ``Classification(config, num_classes, num_tokentypes=2)``: ``[b, s]`` tokens -> logits ``[b, C]`` =
  ``head(dropout(pooler(h)))``; checkpoint keys ``language_model`` and ``classification_head``.
* ``MultipleChoice(config, num_tokentypes=2)``: ``[b, K, s]`` tokens (K choices, each ``[CLS] q+a [SEP] context
  [SEP]``) are folded to ``[b*K, s]``, scored by ``Linear(h, 1)`` and unfolded to logits ``[b, K]``; keys
  ``language_model`` and ``multichoice_head``.

The attention mask is BERT's (``[b, s]`` with 1 = token; the outer product, True = masked). The head weight is
drawn with ``config.init_method`` (N(0, init_method_std)), the bias is zero.

Loading (``load_state_dict``) takes the finetuned model's own checkpoint, or a pretrained BERT checkpoint: the
legacy layout (``language_model`` ...) or megatron-core BERT keys (``embedding.*``, ``encoder.*``, ``pooler.*``,
mapped with the one legacy <-> megatron-core key table, megatron.core.models.conversion.keys). Entries of the
pretraining heads (``lm_head``, ``binary_head``) are ignored; a missing task head keeps its random initialisation
with Megatron's ``***WARNING***`` line; missing token-type embeddings (BERT pretrained with
``--bert-no-binary-head``) likewise; a checkpoint without the pooler cannot be finetuned (error).
"""
from __future__ import annotations

import torch

from megatron.core.models.common.language_model import get_language_model, get_linear_layer
from megatron.core.models.conversion.keys import mcore_to_legacy_key
from megatron.core.models.legacy.bert_model import bert_extended_attention_mask, bert_position_ids
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule, flatten_checkpoint_state_dict
from megatron.core.utils import print_rank_0

_LM_KEY = "language_model"


def _warn_last_rank(message: str) -> None:
    if not torch.distributed.is_initialized() or \
            torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        print(message, flush=True)


def language_model_state(state_dict) -> dict:
    """The ``language_model`` entries (flat, without the prefix) of a finetuned or pretrained BERT checkpoint in
    the legacy layout or with megatron-core keys."""
    flat = flatten_checkpoint_state_dict(state_dict)
    if not any(k.startswith(_LM_KEY + ".") for k in flat):
        flat = {mcore_to_legacy_key(k, "bert"): v for k, v in flat.items()}
    return {k[len(_LM_KEY) + 1:]: v for k, v in flat.items() if k.startswith(_LM_KEY + ".")}


class _PooledHeadModel(MegatronModule):
    """BERT language model with the pooler, plus ``head`` (a replicated Linear) on the pooled output."""

    head_key = ""

    def __init__(self, config, num_outputs, num_tokentypes, pre_process, post_process):
        super().__init__(config=config, share_embeddings_and_output_weights=False)
        self.pre_process = pre_process
        self.post_process = post_process
        self.language_model, self._language_model_key = get_language_model(
            config=config, num_tokentypes=num_tokentypes, add_pooler=True,
            encoder_attn_mask_type=AttnMaskType.padding, pre_process=pre_process, post_process=post_process)
        if post_process:
            self.head_dropout = torch.nn.Dropout(config.hidden_dropout)
            setattr(self, self.head_key, get_linear_layer(config.hidden_size, num_outputs, config.init_method,
                                                          config=config))

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    def _pooled_logits(self, input_ids, attention_mask, tokentype_ids):
        """Head logits ``[n, num_outputs]`` on the last stage; the hidden states elsewhere."""
        position_ids = bert_position_ids(input_ids)
        lm_output = self.language_model(input_ids, position_ids, bert_extended_attention_mask(attention_mask),
                                        tokentype_ids=tokentype_ids)
        if not self.post_process:
            return lm_output
        _, pooled_output = lm_output
        return getattr(self, self.head_key)(self.head_dropout(pooled_output))

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        state = {self._language_model_key: self.language_model.state_dict_for_save_checkpoint(
            prefix=prefix, keep_vars=keep_vars)}
        if self.post_process:
            state[self.head_key] = getattr(self, self.head_key).state_dict(prefix=prefix, keep_vars=keep_vars)
        return state

    def load_state_dict(self, state_dict, strict=True):
        """Load a finetuned checkpoint of this model or a pretrained BERT's (see the module docstring)."""
        lm_state = language_model_state(state_dict)
        own = self.language_model.state_dict()
        if self.post_process and "pooler.dense.weight" in own and "pooler.dense.weight" not in lm_state:
            raise RuntimeError("the checkpoint has no pooler (language_model.pooler / pooler.dense): a BERT "
                               "pretrained with --bert-no-binary-head cannot be finetuned with the classification "
                               "heads")
        tokentype = "embedding.tokentype_embeddings.weight"
        if tokentype in own and tokentype not in lm_state:
            print_rank_0("***WARNING*** expected tokentype embeddings in the checkpoint but could not find it")
            lm_state[tokentype] = own[tokentype]
        self.language_model.load_state_dict(lm_state, strict=strict)
        if not self.post_process:
            return
        flat = flatten_checkpoint_state_dict(state_dict)
        head_state = {k[len(self.head_key) + 1:]: v for k, v in flat.items() if k.startswith(self.head_key + ".")}
        if head_state:
            getattr(self, self.head_key).load_state_dict(head_state, strict=strict)
        else:
            _warn_last_rank(f"***WARNING*** could not find {self.head_key} in the checkpoint, initializing to random")


class Classification(_PooledHeadModel):
    """``Classification(config, num_classes, num_tokentypes=2, pre_process=True, post_process=True)``;
    ``forward(model_input [b, s], attention_mask [b, s], tokentype_ids=None)`` -> logits ``[b, num_classes]``."""

    head_key = "classification_head"

    def __init__(self, config, num_classes, num_tokentypes=2, pre_process=True, post_process=True):
        self.num_classes = num_classes
        super().__init__(config, num_classes, num_tokentypes, pre_process, post_process)

    def forward(self, model_input, attention_mask, tokentype_ids=None):
        out = self._pooled_logits(model_input, attention_mask, tokentype_ids)
        return out.view(-1, self.num_classes) if self.post_process else out


class MultipleChoice(_PooledHeadModel):
    """``MultipleChoice(config, num_tokentypes=2, pre_process=True, post_process=True)``;
    ``forward(model_input [b, K, s], attention_mask [b, K, s], tokentype_ids=None)`` -> logits ``[b, K]``."""

    head_key = "multichoice_head"

    def __init__(self, config, num_tokentypes=2, pre_process=True, post_process=True):
        super().__init__(config, 1, num_tokentypes, pre_process, post_process)

    def forward(self, model_input, attention_mask, tokentype_ids=None):
        if attention_mask.dim() != 3:
            raise ValueError(f"MultipleChoice expects [batch, choices, seq] inputs, got {tuple(attention_mask.shape)}")
        num_choices, seq = attention_mask.shape[1], attention_mask.shape[-1]
        tokentype_ids = tokentype_ids.reshape(-1, seq) if tokentype_ids is not None else None
        out = self._pooled_logits(model_input.reshape(-1, seq), attention_mask.reshape(-1, seq), tokentype_ids)
        return out.view(-1, num_choices) if self.post_process else out
