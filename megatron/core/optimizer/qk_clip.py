"""QK-clip (MuonClip): keep the attention logits of every layer under a threshold, as recommended with Muon.

``clip_qk`` walks the decoder layers of every model chunk; for each attention that supports it (has a
``clip_qk()`` method) it takes the maximum over the data-parallel x context-parallel group of the per-head maximum
logits its core attention recorded in the last forward pass (``core_attention.current_max_attn_logits``), and,
unless ``log_max_only``, lets the attention rescale its query / key weights (``self_attention.clip_qk()``).
Layers whose attention has no ``clip_qk`` are skipped, so a model without QK-clip support returns 0.0.
"""
from __future__ import annotations

import torch

from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model


def clip_qk(model, log_max_only=False) -> float:
    """Clip the QK logits of ``model`` (a list of model chunks, wrapped or not); return the largest attention
    logit seen over all layers and all DP x CP ranks (0.0 when no layer supports QK-clip)."""
    largest = 0.0
    with torch.no_grad():
        for chunk in model:
            for layer in get_attr_wrapped_model(chunk, "decoder").layers:
                attention = layer.self_attention
                if not hasattr(attention, "clip_qk"):
                    continue
                max_logits = attention.core_attention.current_max_attn_logits
                torch.distributed.all_reduce(max_logits, op=torch.distributed.ReduceOp.MAX,
                                             group=parallel_state.get_data_parallel_group(with_context_parallel=True))
                largest = max(largest, torch.max(max_logits).item())
                if not log_max_only:
                    attention.clip_qk()
    return largest
