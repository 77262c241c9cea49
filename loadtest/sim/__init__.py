"""A simulated vLLM replica: a pure engine model plus vLLM's HTTP surface (`kvgate sim`)."""

from loadtest.sim.costmodel import PRESETS, CostModel, Preset, get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.spec import EngineConfig, EngineStats, RequestOutput, RequestSpec

__all__ = [
    "PRESETS",
    "CostModel",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Preset",
    "RequestOutput",
    "RequestSpec",
    "get_preset",
]
