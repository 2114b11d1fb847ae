"""Megatron's legacy submodule names at the state-dict boundary of the legacy classes (``ParallelAttention``,
``ParallelMLP``, ``ParallelTransformerLayer``).

Modules are always built with megatron-core's child names (``linear_qkv``, ``linear_fc1`` ...); a legacy class
installs :func:`install_legacy_state_dict_names`, which renames its direct children on ``state_dict()`` and back on
``load_state_dict()``. The whole-key converters of ``megatron.core.models.conversion.keys`` are derived from this
one table.
"""
from __future__ import annotations

# THE name table: megatron-core submodule name -> Megatron's legacy name, per legacy module kind (direct
# children only).
LEGACY_SUBMODULE_NAMES = {
    "attention": {"linear_qkv": "query_key_value", "linear_q": "query", "linear_kv": "key_value",
                  "linear_proj": "dense"},
    "mlp": {"linear_fc1": "dense_h_to_4h", "linear_fc2": "dense_4h_to_h"},
    "encoder_layer": {"pre_mlp_layernorm": "post_attention_layernorm"},
    "decoder_layer": {"pre_cross_attn_layernorm": "post_attention_layernorm", "cross_attention": "inter_attention",
                      "pre_mlp_layernorm": "post_inter_attention_layernorm"},
}


def _rename_children(state_dict, prefix: str, table: dict) -> None:
    """Rename, in place and keeping the order, the keys ``{prefix}{child}.*`` whose ``child`` is in ``table``."""
    renamed, changed = [], False
    for key, value in state_dict.items():
        if key.startswith(prefix):
            child, dot, rest = key[len(prefix):].partition(".")
            if dot and child in table:
                key, changed = prefix + table[child] + "." + rest, True
        renamed.append((key, value))
    if changed:
        state_dict.clear()
        state_dict.update(renamed)


def install_legacy_state_dict_names(module, kind: str) -> None:
    """Make ``module`` (built with megatron-core child names) save and load its children under Megatron's legacy
    names of ``LEGACY_SUBMODULE_NAMES[kind]``: the state-dict boundary of the legacy classes."""
    table = LEGACY_SUBMODULE_NAMES[kind]
    inverse = {legacy: mcore for mcore, legacy in table.items()}

    def save_hook(mod, state_dict, prefix, local_metadata):
        _rename_children(state_dict, prefix, table)

    def load_pre_hook(state_dict, prefix, *unused):
        _rename_children(state_dict, prefix, inverse)

    module._register_state_dict_hook(save_hook)
    module._register_load_state_dict_pre_hook(load_pre_hook)
