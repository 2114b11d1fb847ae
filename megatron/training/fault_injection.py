"""Test-only fault injection, driven by one environment variable (zero cost when it is unset).

    MEGATRON_FAULT_INJECT="nan_grad:rank=1:iter=3"          one fault
    MEGATRON_FAULT_INJECT="nan_loss:iter=2,raise:rank=0"     several, comma-separated

Each entry is ``kind[:rank=R][:iter=K]``; a missing ``rank`` or ``iter`` matches every rank or iteration.
Kinds used by the framework: ``nan_grad`` (a NaN written into this rank's local gradient before the
data-parallel reduction), ``nan_loss`` (this rank's local loss made NaN), ``raise`` (an exception).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

ENV_VAR = "MEGATRON_FAULT_INJECT"

_parsed: Tuple[Optional[str], List[Tuple[str, Optional[int], Optional[int]]]] = (None, [])


def _parse(spec: str) -> List[Tuple[str, Optional[int], Optional[int]]]:
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, *fields = entry.split(":")
        values = {"rank": None, "iter": None}
        for field in fields:
            key, sep, value = field.partition("=")
            if not sep or key not in values or not value.strip().isdigit():
                raise ValueError(f"{ENV_VAR}={spec!r}: bad field {field!r} in {entry!r}; expected "
                                 "kind[:rank=R][:iter=K]")
            values[key] = int(value)
        faults.append((kind, values["rank"], values["iter"]))
    return faults


def fault_requested(kind: str, rank: int, iteration: int) -> bool:
    """True when ``MEGATRON_FAULT_INJECT`` asks for fault ``kind`` on ``rank`` at ``iteration``."""
    global _parsed
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return False
    if spec != _parsed[0]:
        _parsed = (spec, _parse(spec))
    return any(k == kind and r in (None, rank) and i in (None, iteration) for k, r, i in _parsed[1])
