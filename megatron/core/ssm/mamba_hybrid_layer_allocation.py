"""The hybrid layer pattern (``--hybrid-layer-pattern``): one character per layer, each its own pre-norm + residual.

``M`` Mamba-2 mixer, ``*`` self-attention, ``-`` dense MLP, ``E`` mixture-of-experts MLP. ``|`` separates pipeline
segments (e.g. ``"M-M*|M-M-"``): the number of segments must be a multiple of the pipeline size ``PP``, the virtual
pipeline size is ``segments / PP``, and rank (pp, vp) builds segment ``vp·PP + pp``, whose first layer's global
index is the number of layer characters of all earlier segments. Without ``|`` the layers are split evenly over
the pipeline stages. ``/`` starts the multi-token-prediction part (``"<main>/<mtp>/<mtp>"``) and ``G`` (Gated
DeltaNet), ``D`` (DSA) and ``+`` (MLA) are layer types of Megatron-LM that this library does not build: they are
refused with one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple


class Symbols:
    MAMBA = "M"
    ATTENTION = "*"
    MLP = "-"
    MOE = "E"
    GDN = "G"
    DSA = "D"
    MLA = "+"
    PIPE = "|"
    MTP = "/"
    VALID = {MAMBA, ATTENTION, MLP, MOE}


_NOT_BUILT = {Symbols.GDN: "Gated DeltaNet layers", Symbols.DSA: "DSA (sparse MLA) layers",
              Symbols.MLA: "multi-latent attention layers"}


class HybridPatternError(ValueError):
    """A pattern that cannot be built; the message names --hybrid-layer-pattern and the fix."""


@dataclass(frozen=True)
class HybridPattern:
    """A parsed pattern: the pipeline segments of the main decoder (their concatenation is one character per
    layer)."""

    segments: Tuple[str, ...]

    @property
    def layers(self) -> str:
        return "".join(self.segments)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def has_pipe(self) -> bool:
        return len(self.segments) > 1

    def count(self, symbol: str) -> int:
        return self.layers.count(symbol)


def parse_hybrid_pattern(pattern: str, flag: str = "--hybrid-layer-pattern") -> HybridPattern:
    """Validate ``pattern`` and split it into pipeline segments (see the module docstring)."""
    if not pattern:
        raise HybridPatternError(f"{flag} is empty: give one character per layer, e.g. 'M-M*-'")
    if Symbols.MTP in pattern:
        raise HybridPatternError(f"{flag} {pattern!r}: multi-token-prediction layers ('/' parts) of hybrid models are "
                                 "not implemented yet in this library; drop the '/...' part")
    segments = tuple(pattern.split(Symbols.PIPE))
    for char in "".join(segments):
        if char in _NOT_BUILT:
            raise HybridPatternError(f"{flag} {pattern!r}: '{char}' ({_NOT_BUILT[char]}) is not implemented yet in "
                                     "this library; use M, *, - and E")
        if char not in Symbols.VALID:
            raise HybridPatternError(f"{flag} {pattern!r}: unknown layer symbol {char!r}; use M (Mamba), "
                                     "* (attention), - (MLP), E (MoE) and | (pipeline boundary)")
    if any(not s for s in segments):
        raise HybridPatternError(f"{flag} {pattern!r}: a pipeline segment between '|' is empty")
    return HybridPattern(segments)


def virtual_pipeline_size(pattern: HybridPattern, pp: int) -> Optional[int]:
    """Megatron's derived virtual pipeline size (None without ``|`` or with one segment per stage)."""
    if not pattern.has_pipe:
        return None
    if len(pattern.segments) % pp:
        raise HybridPatternError(f"--hybrid-layer-pattern has {len(pattern.segments)} pipeline segments ('|'), which "
                                 f"is not a multiple of --pipeline-model-parallel-size ({pp})")
    vpp = len(pattern.segments) // pp
    return vpp if vpp > 1 else None


def layers_of_stage(pattern: HybridPattern, pp: int, pp_rank: int, vp_rank: int = 0) -> Tuple[int, str]:
    """(global index of the first layer, layer characters) built by pipeline rank ``pp_rank``, chunk ``vp_rank``."""
    if pattern.has_pipe:
        if len(pattern.segments) % pp:
            virtual_pipeline_size(pattern, pp)  # raises with the message
        index = vp_rank * pp + pp_rank
        return len("".join(pattern.segments[:index])), pattern.segments[index]
    if pattern.num_layers % pp:
        raise HybridPatternError(f"--hybrid-layer-pattern has {pattern.num_layers} layers, not divisible by "
                                 f"--pipeline-model-parallel-size ({pp}): split it with '|' into segments")
    per_stage = pattern.num_layers // pp
    return pp_rank * per_stage, pattern.layers[pp_rank * per_stage:(pp_rank + 1) * per_stage]


def allocate_layers(total_layers_count: int, target_attention_ratio: float = 0.0, target_mlp_ratio: float = 0.0,
                    override_pattern: Optional[str] = None) -> List[str]:
    """megatron-core 0.16.1's entry point: the layer symbols of ``override_pattern`` (ratio-based allocation is
    refused: give the pattern)."""
    if override_pattern is None:
        if target_attention_ratio or target_mlp_ratio:
            raise HybridPatternError("--hybrid-attention-ratio / --hybrid-mlp-ratio allocation is not implemented: "
                                     "give the layers with --hybrid-layer-pattern")
        return [Symbols.MAMBA] * total_layers_count
    pattern = parse_hybrid_pattern(override_pattern)
    if total_layers_count and total_layers_count != pattern.num_layers:
        raise HybridPatternError(f"the hybrid pattern has {pattern.num_layers} layers, the model {total_layers_count}")
    return list(pattern.layers)
