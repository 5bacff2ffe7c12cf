"""idlegrid: idle volunteer machines as one pool for machine-learning work."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from idlegrid.client import Client, Job

__all__ = ["Client", "Job", "__version__"]


def __getattr__(name: str) -> Any:
    # The SDK is imported lazily so `import idlegrid.protocol` stays light on workers.
    if name in {"Client", "Job"}:
        from idlegrid import client

        return getattr(client, name)
    raise AttributeError(name)
