"""The sharded (torch_dist) state of the legacy model classes: megatron-core's checkpoint keys.

A legacy model is built from the same modules as its megatron-core twin, under other top-level names
(``language_model.embedding`` / ``language_model.encoder`` / ``lm_head.bias`` ...). Its sharded state is the default
walk of its modules with each checkpoint key renamed by the one legacy -> megatron-core table
(:func:`megatron.core.models.conversion.keys.legacy_to_mcore_key`), so a legacy model and a megatron-core model
write the same checkpoint. The last stage's copy of a tied embedding (``word_embeddings``) is saved as a
non-main replica ``(1, 0, dp)`` of ``embedding.word_embeddings.weight``.
"""
from __future__ import annotations

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.models.conversion.keys import legacy_to_mcore_key
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import get_pg_rank, make_tp_sharded_tensor_for_checkpoint

VOCAB_SIZED = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias",
               "lm_head.output_layer.bias")


def legacy_sharded_state_dict(model, kind: str, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
    """``model``'s sharded state with megatron-core's keys (``kind``: 'gpt', 'bert' or 't5')."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    out = MegatronModule.sharded_state_dict(model, prefix, sharded_offsets, metadata)

    def rename(leaf):
        if isinstance(leaf, ShardedBase) and leaf.key.startswith(prefix):
            leaf.key = prefix + legacy_to_mcore_key(leaf.key[len(prefix):], kind)
        return leaf

    dict_list_map_inplace(rename, out)
    copy_key = f"{prefix}word_embeddings.weight"
    if copy_key in out:  # the last stage's tied copy
        dp_cp_group = metadata["dp_cp_group"]
        out[copy_key] = make_tp_sharded_tensor_for_checkpoint(
            model.word_embeddings.weight, f"{prefix}embedding.word_embeddings.weight",
            replica_id=(1, 0, get_pg_rank(dp_cp_group)), allow_shape_mismatch=True, dp_cp_group=dp_cp_group)
    for leaf in out.values():
        if getattr(leaf, "key", "").endswith(VOCAB_SIZED) and hasattr(leaf, "allow_shape_mismatch"):
            leaf.allow_shape_mismatch = True
    return out
