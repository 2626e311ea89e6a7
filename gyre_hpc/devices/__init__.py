"""The device cost model: what an engine's batch step, a prefill and a training micro-batch
cost, and what a cell's memory holds (``model``), and the named devices (``presets``).

A package of its own in the bottom row because the simulator (``sim``) and paced engines and
cells (``engines.pacing``) both price work with it; it imports only the standard library.
"""
from gyre_hpc.devices.model import DeviceError, EngineModel, TrainModel
from gyre_hpc.devices.presets import DEVICE_PRESETS, device_preset

__all__ = ["DEVICE_PRESETS", "DeviceError", "EngineModel", "TrainModel", "device_preset"]
