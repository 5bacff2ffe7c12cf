"""Ready queue and presence behind the `Broker` interface."""

from idlegrid.broker.base import Broker
from idlegrid.broker.memory import MemoryBroker

__all__ = ["Broker", "MemoryBroker"]
