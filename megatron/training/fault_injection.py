"""Test-only fault injection, driven by one environment variable (zero cost when it is unset).

    MEGATRON_FAULT_INJECT="nan_grad:rank=1:iter=3"          one fault
    MEGATRON_FAULT_INJECT="nan_loss:iter=2,raise:rank=0"     several, comma-separated

Each entry is ``kind[:rank=R][:iter=K][:delay=S][:attempt=A]``; a missing ``rank`` or ``iter`` matches every rank
or iteration; ``delay`` (seconds) makes the process sleep before the fault; ``attempt`` matches only that restart
of the job (torchrun's ``TORCHELASTIC_RESTART_COUNT``, 0 for the first run; any attempt when missing). Kinds used
by the framework:

* ``nan_grad`` (a NaN written into this rank's local gradient before the data-parallel reduction) and
  ``nan_loss`` (this rank's local loss made NaN): megatron/training/numerical_checks.py;
* ``raise`` (a ZeroDivisionError at the start of the iteration), ``kill`` (SIGKILL itself), ``sigterm`` (SIGTERM
  to itself only), ``sigterm_group`` (SIGTERM to its whole process group, as SLURM or a batch system does):
  megatron/training/fault_handling.py ``maybe_inject_fault``;
* ``stall`` (sleep ``delay`` seconds, forever when 0, inside the ``finalize_model_grads`` collective phase: a rank
  stuck in Python while its peers wait in the gradient all-reduce) and ``slow`` (sleep ``delay`` seconds before
  each training micro-batch's forward: a straggler that keeps progressing):
  megatron/training/hang_detection.py ``ProgressTracker``.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Tuple

ENV_VAR = "MEGATRON_FAULT_INJECT"
KINDS = ("nan_grad", "nan_loss", "raise", "kill", "sigterm", "sigterm_group", "stall", "slow")

Fault = Tuple[str, Optional[int], Optional[int], float, Optional[int]]  # kind, rank, iteration, delay (s), attempt
_parsed: Tuple[Optional[str], List[Fault]] = (None, [])


def _parse(spec: str) -> List[Fault]:
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        kind, *fields = entry.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV_VAR}={spec!r}: unknown fault kind {kind!r}; expected one of {', '.join(KINDS)}")
        values = {"rank": None, "iter": None, "delay": 0.0, "attempt": None}
        for field in fields:
            key, sep, value = field.partition("=")
            try:
                values[key] = (float if key == "delay" else int)(value) if sep and key in values else None
            except ValueError:
                values[key] = None
            if values.get(key) is None:
                raise ValueError(f"{ENV_VAR}={spec!r}: bad field {field!r} in {entry!r}; expected "
                                 "kind[:rank=R][:iter=K][:delay=S][:attempt=A]")
        faults.append((kind, values["rank"], values["iter"], values["delay"], values["attempt"]))
    return faults


def _faults() -> List[Fault]:
    global _parsed
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return []
    if spec != _parsed[0]:
        _parsed = (spec, _parse(spec))
    return _parsed[1]


def requested_fault(kinds: Iterable[str], rank: int, iteration: int) -> Optional[Tuple[str, float]]:
    """The first requested fault among ``kinds`` for ``rank`` at ``iteration``, as (kind, delay), or None."""
    faults = _faults()
    if not faults:
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    for kind, r, i, delay, a in faults:
        if kind in kinds and r in (None, rank) and i in (None, iteration) and a in (None, attempt):
            return kind, delay
    return None


def fault_requested(kind: str, rank: int, iteration: int) -> bool:
    """True when ``MEGATRON_FAULT_INJECT`` asks for fault ``kind`` on ``rank`` at ``iteration``."""
    return requested_fault((kind,), rank, iteration) is not None
