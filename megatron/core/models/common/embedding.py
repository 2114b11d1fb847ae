"""Input embeddings: vocabulary-parallel word embeddings + learned positions + token types, to ``[s, b, h]``.

``Embedding`` is Megatron's legacy class; megatron-core's ``LanguageModelEmbedding`` is the same class with
megatron-core's constructor. State-dict keys (``word_embeddings``, ``position_embeddings``,
``tokentype_embeddings``) are the same in both.
"""
from __future__ import annotations

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import param_device


class Embedding(MegatronModule):
    """``Embedding(hidden_size, vocab_size, max_sequence_length, embedding_dropout_prob, config, num_tokentypes=0,
    embedding_weights_in_fp32=False)``; ``forward(input_ids [b, s], position_ids [b, s], tokentype_ids=None)
    -> [s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism)."""

    def __init__(self, hidden_size, vocab_size, max_sequence_length, embedding_dropout_prob, config, num_tokentypes=0,
                 embedding_weights_in_fp32=False, *, position_embedding_type=None, scatter_to_sequence_parallel=True,
                 tp_group=None):
        super().__init__(config=config)
        self.tp_group = tp_group  # the vocabulary split; None = parallel_state's TP group
        self.hidden_size = hidden_size
        self.init_method = config.init_method
        self.num_tokentypes = num_tokentypes
        self.params_dtype = config.params_dtype
        self.embedding_weights_in_fp32 = embedding_weights_in_fp32
        self.fp32_residual_connection = config.fp32_residual_connection
        self.sequence_parallel = config.sequence_parallel
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel

        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(vocab_size, self.hidden_size, config=config,
                                                                      init_method=config.init_method,
                                                                      tp_group=tp_group)
        self._word_embeddings_key = "word_embeddings"

        if position_embedding_type is None:
            position_embedding_type = config.position_embedding_type
        self.add_position_embedding = (position_embedding_type == "learned_absolute"
                                       and config.add_position_embedding)
        if self.add_position_embedding:
            if max_sequence_length is None:
                raise ValueError("learned absolute position embeddings need --max-position-embeddings "
                                 "(config.max_position_embeddings)")
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, self.hidden_size,
                                                          dtype=config.params_dtype, device=param_device(config))
            self._position_embeddings_key = "position_embeddings"
            self._init_table(self.position_embeddings)

        self._tokentype_embeddings_key = "tokentype_embeddings"
        if self.num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(self.num_tokentypes, self.hidden_size,
                                                           dtype=config.params_dtype, device=param_device(config))
            self._init_table(self.tokentype_embeddings)
        else:
            self.tokentype_embeddings = None

        self.embedding_dropout = torch.nn.Dropout(embedding_dropout_prob)

    def _init_table(self, table: torch.nn.Embedding) -> None:
        """A position / token-type table after torch's own initialisation (which its constructor ran): init_method."""
        if self.config.perform_initialization:
            self.init_method(table.weight)

    def reset_parameters(self):
        """Every table drawn again in the constructor's order (the meta-device materialisation calls it)."""
        self.word_embeddings.reset_parameters()
        for table in (getattr(self, "position_embeddings", None), self.tokentype_embeddings):
            if table is not None:
                table.reset_parameters()
                self._init_table(table)

    def zero_parameters(self):
        """Zero every parameter (a stage that receives the real values by all-reduce)."""
        self.word_embeddings.weight.data.fill_(0)
        self.word_embeddings.weight.shared = True
        if self.add_position_embedding:
            self.position_embeddings.weight.data.fill_(0)
            self.position_embeddings.weight.shared = True
        if self.num_tokentypes > 0:
            self.tokentype_embeddings.weight.data.fill_(0)
            self.tokentype_embeddings.weight.shared = True

    def add_tokentype_embeddings(self, num_tokentypes):
        """Add token-type embeddings to a pretrained model (e.g. finetuning a GPT on paired inputs)."""
        if self.tokentype_embeddings is not None:
            raise Exception("tokentype embeddings is already initialized")
        print(f"adding embedding for {num_tokentypes} tokentypes", flush=True)
        self.num_tokentypes = num_tokentypes
        self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, self.hidden_size, dtype=self.params_dtype,
                                                       device=self.word_embeddings.weight.device)
        self.init_method(self.tokentype_embeddings.weight)

    def forward(self, input_ids, position_ids, tokentype_ids=None):
        if self.embedding_weights_in_fp32:
            self.word_embeddings = self.word_embeddings.to(torch.float32)
        words_embeddings = self.word_embeddings(input_ids)
        if self.embedding_weights_in_fp32:
            words_embeddings = words_embeddings.to(self.params_dtype)
            self.word_embeddings = self.word_embeddings.to(self.params_dtype)
        if self.add_position_embedding:
            embeddings = words_embeddings + self.position_embeddings(position_ids)
        else:
            embeddings = words_embeddings

        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids were given but the model has no token-type embeddings (num_tokentypes=0)")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
        elif self.tokentype_embeddings is not None:
            raise ValueError(f"the model has {self.num_tokentypes} token types: pass tokentype_ids")

        # [b, s, h] -> [s, b, h]
        embeddings = embeddings.transpose(0, 1).contiguous()
        if self.fp32_residual_connection:
            embeddings = embeddings.float()

        if self.sequence_parallel and self.scatter_to_sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, self.tp_group)
            # Each TP rank holds different tokens now: their dropout masks must differ.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                embeddings = self.embedding_dropout(embeddings)
        else:
            embeddings = self.embedding_dropout(embeddings)
        return embeddings

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        """Megatron's nested layout: ``{'word_embeddings': {...}, 'position_embeddings': {...}, ...}``."""
        state_dict_ = {self._word_embeddings_key: self.word_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars)}
        if self.add_position_embedding:
            state_dict_[self._position_embeddings_key] = self.position_embeddings.state_dict(
                prefix=prefix, keep_vars=keep_vars)
        if self.num_tokentypes > 0:
            state_dict_[self._tokentype_embeddings_key] = self.tokentype_embeddings.state_dict(
                prefix=prefix, keep_vars=keep_vars)
        return state_dict_


class LanguageModelEmbedding(Embedding):
    """megatron-core: ``LanguageModelEmbedding(config, vocab_size, max_sequence_length,
    position_embedding_type='learned_absolute', num_tokentypes=0, scatter_to_sequence_parallel=True,
    tp_group=None)``; without ``scatter_to_sequence_parallel`` the output stays whole under sequence parallelism."""

    def __init__(self, config, vocab_size, max_sequence_length, position_embedding_type="learned_absolute",
                 num_tokentypes=0, scatter_to_sequence_parallel: bool = True, tp_group=None):
        super().__init__(config.hidden_size, vocab_size, max_sequence_length, config.hidden_dropout, config,
                         num_tokentypes=num_tokentypes, position_embedding_type=position_embedding_type,
                         scatter_to_sequence_parallel=scatter_to_sequence_parallel, tp_group=tp_group)
