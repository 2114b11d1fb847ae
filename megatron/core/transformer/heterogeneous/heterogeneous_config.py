"""``HeterogeneousTransformerConfig``: a transformer whose layers differ (NVIDIA's Nemotron-NAS architecture, e.g.
Llama-3.1-Nemotron-51B, Llama-3.3-Nemotron-Super-49B), described by the ``block_configs`` list of the Hugging Face
``config.json`` of those models, one entry per layer::

    {"block_configs": [
        {"attention": {"n_heads_in_group": 8, "no_op": false, "replace_with_linear": false},
         "ffn": {"ffn_mult": 2.625, "no_op": false, "replace_with_linear": false}},
        {"attention": {"n_heads_in_group": null, "no_op": true, "replace_with_linear": false},
         "ffn": {"ffn_mult": 2.625, "no_op": false, "replace_with_linear": false}}]}

Per layer: the attention is a grouped-query attention with ``num_query_groups`` groups, a no-op (the layer skips
it, norm included), or one linear ``hidden -> hidden`` layer (``replace_with_linear``); the MLP (``"ffn"`` or
``"mlp"``) is an MLP of ``ffn_hidden_size``, a no-op, or one linear layer. Hugging Face's spellings are converted:
``num_query_groups = num_attention_heads / n_heads_in_group`` (which must divide) and
``ffn_hidden_size = round_up(int(2 * ffn_mult * hidden_size / 3), 256)``; ``null`` keeps the model's value.
Keys other than the dataclass fields are ignored.

The JSON is read from ``heterogeneous_layers_config_path`` unless ``heterogeneous_layers_config_encoded_json``
already holds it (the text is kept in the config, hence in checkpoints). ``get_config_for_layer(n)`` is the
plain :class:`TransformerConfig` of global layer ``n`` (1-based): this config with the layer's
``num_query_groups`` / ``ffn_hidden_size``; the transformer block builds every layer from its own config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig


def _known_fields(cls, entries: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in entries.items() if key in names}


@dataclass
class AttentionConfig:
    """The attention of one layer: ``no_op`` (skipped), ``replace_with_linear`` (one linear layer), or a
    grouped-query attention with ``num_query_groups`` groups (None: the model's)."""

    no_op: bool = False
    replace_with_linear: bool = False
    num_query_groups: Optional[int] = None

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, num_attention_heads: int) -> "AttentionConfig":
        """From a ``block_configs`` entry: its ``"attention"`` dict, with Hugging Face's ``n_heads_in_group``
        turned into ``num_query_groups`` when that is absent (ValueError unless it divides the heads).
        The entry's ``"attention"`` dict is updated in place (as megatron-core does)."""
        entries = block_config_dict["attention"]
        if "num_query_groups" not in entries:
            heads_in_group = entries.pop("n_heads_in_group")
            groups = None
            if heads_in_group is not None:
                if num_attention_heads % heads_in_group != 0:
                    raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                                     f"n_heads_in_group ({heads_in_group}).")
                groups = num_attention_heads // heads_in_group
            entries["num_query_groups"] = groups
        return cls(**_known_fields(cls, entries))


@dataclass
class MLPConfig:
    """The MLP of one layer: ``no_op`` (skipped), ``replace_with_linear`` (one linear layer), or an MLP of
    ``ffn_hidden_size`` (None: the model's)."""

    no_op: bool = False
    replace_with_linear: bool = False
    ffn_hidden_size: Optional[float] = None

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, hidden_size: int) -> "MLPConfig":
        """From a ``block_configs`` entry: its ``"ffn"`` (else ``"mlp"``) dict, with Hugging Face's ``ffn_mult``
        turned into ``ffn_hidden_size`` (:meth:`ffn_mult_to_intermediate_size`) when that is absent. The dict is
        updated in place."""
        entries = block_config_dict.get("ffn") or block_config_dict.get("mlp")
        if "ffn_hidden_size" not in entries:
            mult = entries.pop("ffn_mult")
            entries["ffn_hidden_size"] = None if mult is None else cls.ffn_mult_to_intermediate_size(mult, hidden_size)
        return cls(**_known_fields(cls, entries))

    @staticmethod
    def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
        """``find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)`` (the SwiGLU 2/3 rule of the Nemotron-NAS
        models; e.g. 2.625 x 8192 -> 14336)."""
        return MLPConfig.find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)

    @staticmethod
    def find_multiple(n: int, k: int) -> int:
        """The smallest multiple of ``k`` that is ``>= n``."""
        return n if n % k == 0 else n + k - n % k


@dataclass
class TransformerBlockConfig:
    """One layer of a heterogeneous transformer: its attention and its MLP."""

    attention: AttentionConfig
    mlp: MLPConfig


@dataclass
class HeterogeneousTransformerConfig(TransformerConfig):
    """A :class:`TransformerConfig` with one :class:`TransformerBlockConfig` per layer (module docstring):
    ``heterogeneous_layers_config_path`` (the JSON file) or ``heterogeneous_layers_config_encoded_json`` (its
    text); ``per_block_parameters`` is parsed from it and ``heterogeneous_block_specs`` is set."""

    heterogeneous_layers_config_path: str = ""
    heterogeneous_layers_config_encoded_json: str = ""
    per_block_parameters: list = field(init=False)

    def __post_init__(self):
        super().__post_init__()
        self.heterogeneous_block_specs = True
        if self.heterogeneous_layers_config_encoded_json in ("", None):
            if not self.heterogeneous_layers_config_path:
                raise ValueError("HeterogeneousTransformerConfig needs heterogeneous_layers_config_path (the JSON "
                                 "with \"block_configs\", --heterogeneous-layers-config-path) or "
                                 "heterogeneous_layers_config_encoded_json")
            self.heterogeneous_layers_config_encoded_json = Path(self.heterogeneous_layers_config_path).read_text()
        layers = json.loads(self.heterogeneous_layers_config_encoded_json)
        if "block_configs" not in layers:
            raise ValueError("the heterogeneous layers config has no \"block_configs\" list (one entry per layer)")
        self.per_block_parameters = [
            TransformerBlockConfig(
                attention=AttentionConfig.build_config_from_dict(block, num_attention_heads=self.num_attention_heads),
                mlp=MLPConfig.build_config_from_dict(block, hidden_size=self.hidden_size))
            for block in layers["block_configs"]]

    def get_config_for_layer(self, layer_number: int) -> TransformerConfig:
        """The plain :class:`TransformerConfig` of global layer ``layer_number`` (1-based; ValueError outside
        ``[1, number of blocks]``): every TransformerConfig field of this config, with the block's
        ``num_query_groups`` / ``ffn_hidden_size`` where it sets them (a block that sets them must be a real
        attention / MLP, not a no-op or linear replacement)."""
        count = len(self.per_block_parameters)
        if not 1 <= layer_number <= count:
            raise ValueError(f"Invalid layer number: {layer_number}. Should be in range [1, {count}].")
        block = self.per_block_parameters[layer_number - 1]
        overrides = {}
        if block.attention.num_query_groups is not None:
            if block.attention.replace_with_linear or block.attention.no_op:
                raise ValueError(f"layer {layer_number}: num_query_groups is set for a no-op / linear attention")
            overrides["num_query_groups"] = block.attention.num_query_groups
        if block.mlp.ffn_hidden_size is not None:
            if block.mlp.replace_with_linear or block.mlp.no_op:
                raise ValueError(f"layer {layer_number}: ffn_hidden_size is set for a no-op / linear MLP")
            overrides["ffn_hidden_size"] = block.mlp.ffn_hidden_size
        values = {f.name: getattr(self, f.name) for f in fields(TransformerConfig) if f.init}
        values.update(overrides)
        return TransformerConfig(**values)
