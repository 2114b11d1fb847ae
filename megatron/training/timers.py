"""Former home of :mod:`megatron.core.timers` (re-exported)."""
from megatron.core.timers import DummyTimer, Timer, TimerBase, Timers  # noqa: F401

__all__ = ["DummyTimer", "Timer", "TimerBase", "Timers"]
