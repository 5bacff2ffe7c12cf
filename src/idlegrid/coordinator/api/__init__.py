"""The REST API under /v1: jobs, results, blobs (whole or in chunks), tokens, nodes.

Every error is JSON: {"error": <code>, "message": <human-readable text>}. Each resource
has a module that registers its routes on the one `router`.
"""

from idlegrid.coordinator.api import accounts, blobs, jobs, uploads
from idlegrid.coordinator.api.common import (
    ApiError,
    error_response,
    error_responses,
    metrics_reader,
    router,
)

__all__ = [
    "ApiError",
    "accounts",
    "blobs",
    "error_response",
    "error_responses",
    "jobs",
    "metrics_reader",
    "router",
    "uploads",
]
