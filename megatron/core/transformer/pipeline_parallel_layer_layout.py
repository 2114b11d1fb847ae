"""A custom split of the model's layers over pipeline stages (megatron-core's ``--pipeline-model-parallel-layout``).

A layout string lists the stages separated by ``|``, each as characters: ``E`` the embedding, ``t`` a transformer
(decoder) layer, ``m`` a multi-token-prediction depth, ``L`` the loss (output layer). ``(...)*n`` and ``x*n`` repeat,
commas are cosmetic: ``"Ettt|(tt|)*29,m|L"`` is 32 stages. With ``PP`` pipeline ranks the ``PP * VPP`` stages go
round-robin: stage ``i`` is virtual stage ``i // PP`` of rank ``i % PP``. Layer ids count the layers of one type in
that order (virtual stage 0 of every rank, then virtual stage 1, ...).

Only the layout itself lives here: this library's TransformerConfig has no ``pipeline_model_parallel_layout`` yet,
so its blocks still split the layers evenly (``--pipeline-model-parallel-layout`` is refused by the CLI).
"""
from __future__ import annotations

import copy
import logging
import re
from functools import lru_cache
from typing import List, Optional, Union

from megatron.core import parallel_state
from megatron.core._rank_utils import log_single_rank
from megatron.core.transformer.enums import LayerType

logger = logging.getLogger(__name__)

_CHARS = {"E": LayerType.embedding, "L": LayerType.loss, "t": LayerType.decoder, "m": LayerType.mtp}


class PipelineParallelLayerLayout:
    """``PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)``: ``layout`` a string (module docstring)
    or a list of stages, each a list of ``LayerType`` or their names. ``self.layout[pp_rank][vp_stage]`` is a stage;
    ``self.flatten_layout`` all layers in layer-id order."""

    def __init__(self, layout: Union[str, list], pipeline_model_parallel_size: int):
        self.input_data = layout
        stages = self.parse_str_to_list(layout) if isinstance(layout, str) else copy.deepcopy(layout)
        if not all(isinstance(stage, list) for stage in stages):
            raise ValueError(f"pipeline_model_parallel_layout must be a list of lists, got {layout!r}")
        pp = pipeline_model_parallel_size
        if len(stages) % pp != 0:
            raise ValueError(f"pipeline_model_parallel_layout has {len(stages)} stages, not a multiple of "
                             f"pipeline_model_parallel_size ({pp})")
        vpp = len(stages) // pp
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = vpp
        self.layout = [[[self._layer_type(x) for x in stages[v * pp + r]] for v in range(vpp)] for r in range(pp)]
        self.flatten_layout = [x for v in range(vpp) for r in range(pp) for x in self.layout[r][v]]

    @staticmethod
    def _layer_type(value) -> LayerType:
        if isinstance(value, LayerType):
            return value
        if isinstance(value, str) and value.strip().lower() in LayerType.__members__:
            return LayerType[value.strip().lower()]
        raise ValueError(f"{value!r} is not a LayerType")

    def __repr__(self) -> str:
        return self.input_data if isinstance(self.input_data, str) else str(self.input_data)

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int]) -> bool:
        """Check the layout against the model (raises ``ValueError`` naming the rule); returns whether the MTP
        depths sit on another rank than the last (MTP "standalone")."""
        flat, count = self.flatten_layout, self.flatten_layout.count
        rules = [
            (flat[:1] == [LayerType.embedding], f"the first layer must be the embedding (E), got {flat[:1]}"),
            (flat[-1:] == [LayerType.loss], f"the last layer must be the loss (L), got {flat[-1:]}"),
            (count(LayerType.embedding) == 1 and count(LayerType.loss) == 1, "E and L must appear exactly once"),
            (count(LayerType.decoder) == num_layers,
             f"{count(LayerType.decoder)} transformer layers (t) but num_layers is {num_layers}"),
            (count(LayerType.mtp) == (mtp_num_layers or 0),
             f"{count(LayerType.mtp)} MTP layers (m) but mtp_num_layers is {mtp_num_layers}"),
            (LayerType.mtp not in flat or LayerType.decoder not in flat[flat.index(LayerType.mtp):],
             "transformer layers must come before the MTP layers"),
            (all(LayerType.mtp not in stage for row in self.layout for stage in row[:-1]),
             "MTP layers must be in the last virtual stage of their rank"),
            (all(row[-1].count(LayerType.mtp) in (0, mtp_num_layers or 0) for row in self.layout),
             "all MTP layers must be in one stage"),
            (LayerType.mtp not in [x for stage in self.layout[0][:-1] for x in stage],
             "MTP layers cannot be on the first pipeline rank's earlier virtual stages"),
            (LayerType.encoder not in flat, "encoder layers are not supported in a pipeline layout"),
        ]
        for ok, message in rules:
            if not ok:
                raise ValueError(f"pipeline_model_parallel_layout {self!r}: {message}")
        return any(LayerType.mtp in row[-1] for row in self.layout[:-1])

    def _stage(self, vp_stage: Optional[int], pp_rank: Optional[int]):
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vp_stage is None:
            if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
                raise ValueError("vp_stage must be given with virtual pipeline parallelism")
            vp_stage = 0
        return vp_stage, pp_rank

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                                pp_rank: Optional[int] = None) -> int:
        """How many layers of ``layer_type`` the stage ``(pp_rank, vp_stage)`` holds (defaults: this rank)."""
        vp_stage, pp_rank = self._stage(vp_stage, pp_rank)
        return self.layout[pp_rank][vp_stage].count(layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                         pp_rank: Optional[int] = None) -> int:
        """The id of the stage's first ``layer_type`` layer: those of every earlier stage in layer-id order."""
        vp_stage, pp_rank = self._stage(vp_stage, pp_rank)
        earlier = [self.layout[r][v] for v in range(vp_stage + 1)
                   for r in range(self.pipeline_model_parallel_size if v < vp_stage else pp_rank)]
        return sum(stage.count(layer_type) for stage in earlier)

    def get_layer_id_list(self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None,
                          pp_rank: Optional[int] = None) -> List[int]:
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def pretty_repr(self) -> str:
        """One line per pipeline rank, one column per virtual stage, each stage as its characters."""
        chars = {v: k for k, v in _CHARS.items()}
        rows = [f"PP rank {r:>3}: " + " | ".join(
            "".join(chars.get(x, "?") for x in stage) or "-" for stage in self.layout[r])
            for r in range(self.pipeline_model_parallel_size)]
        return "\n".join(rows)

    @staticmethod
    @lru_cache()
    def from_str(layout: str, pipeline_model_parallel_size: int) -> "PipelineParallelLayerLayout":
        parsed = PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)
        log_single_rank(logger, logging.INFO, f"pipeline layout {layout}:\n{parsed.pretty_repr()}")
        return parsed

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    @staticmethod
    def parse_str_to_list(layout_str: str) -> List[List[LayerType]]:
        """``"Ettt|(tt|)*2,m|L"`` -> ``[[E, t, t, t], [t, t], [t, t], [m], [L]]``."""
        text = layout_str.replace(",", "")
        text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        stages = []
        for stage in text.split("|"):
            unknown = [c for c in stage if c not in _CHARS]
            if unknown:
                raise ValueError(f"invalid layer character {unknown[0]!r} in pipeline layout {layout_str!r} "
                                 f"(known: {''.join(_CHARS)})")
            stages.append([_CHARS[c] for c in stage])
        return stages
