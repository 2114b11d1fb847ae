"""Legacy import path ``megatron.timers`` (re-exports of megatron.training.timers)."""
from megatron.training.timers import DummyTimer, Timer, TimerBase, Timers  # noqa: F401
