"""One forward pass of the generation loop over all pipeline stages, with the KV cache (InferenceParams)."""
from __future__ import annotations

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.inference_params import InferenceParams
from megatron.core.utils import get_model_config
from megatron.training.utils import unwrap_model

from .communication import recv_from_prev_pipeline_stage, send_to_next_pipeline_stage


class ForwardStep:
    """``ForwardStep(model, max_batch_size, max_sequence_length)``; ``step(tokens, position_ids, attention_mask)``.

    Feeds ``tokens [b, s]`` (the positions not yet in the cache), advances the cache offset by ``s`` and returns
    the full-vocabulary logits ``[b, s, V]`` on the last pipeline stage (gathered across tensor-parallel ranks
    when the model keeps them vocab-parallel), ``None`` on the other stages. ``use_cache=False`` recomputes the
    whole prefix at every step instead (the reference the KV cache is tested against).
    """

    def __init__(self, model, max_batch_size: int, max_sequence_length: int, use_cache: bool = True):
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise NotImplementedError("generation with virtual pipeline stages (interleaved schedule) is not "
                                          "supported: load the model without --num-layers-per-virtual-pipeline-stage")
            model = model[0]
        model.eval()
        self.model = model
        self.config = get_model_config(model)
        if self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            raise RuntimeError("generation does not support --sequence-parallel: load the model without it "
                               "(the weights are the same)")
        self.parallel_output = getattr(unwrap_model(model), "parallel_output", False)
        self.use_cache = use_cache
        self.inference_params = InferenceParams(max_batch_size, max_sequence_length) if use_cache else None

    def _activation_dtype(self):
        dtype = self.config.params_dtype
        if self.config.fp16:
            dtype = torch.half
        elif self.config.bf16:
            dtype = torch.bfloat16
        return dtype

    @torch.no_grad()
    def __call__(self, tokens, position_ids, attention_mask):
        batch, seq = tokens.shape
        input_tensor = recv_from_prev_pipeline_stage((seq, batch, self.config.hidden_size), self._activation_dtype())
        self.model.set_input_tensor(input_tensor)
        output = self.model(tokens, position_ids, attention_mask, inference_params=self.inference_params)
        send_to_next_pipeline_stage(output)  # no-op on the last stage
        if self.inference_params is not None:
            self.inference_params.sequence_len_offset += seq
        if not parallel_state.is_pipeline_last_stage():
            return None
        logits = output.float()
        if self.parallel_output and parallel_state.get_tensor_model_parallel_world_size() > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits
