"""Rollout engines behind one interface, the KV state they migrate, and its transports."""
from gyre_hpc.engines.base import Engine, EngineError, EngineLoad
from gyre_hpc.engines.kv_state import KVLayout, KVState
from gyre_hpc.engines.requests import EngineCounters, Output, Request, SamplingParams, TokenEvent

__all__ = ["Engine", "EngineError", "EngineLoad", "KVLayout", "KVState", "EngineCounters", "Output", "Request",
           "SamplingParams", "TokenEvent"]
