"""API and node tokens: random secrets shown once, stored only as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets
from typing import Literal

TokenKind = Literal["api", "node"]
_PREFIX = {"api": "igr_", "node": "ign_"}


def new_token(kind: TokenKind) -> str:
    """A fresh token; its prefix tells researcher (igr_) and node (ign_) tokens apart."""
    return _PREFIX[kind] + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    # Tokens carry 256 random bits, so a plain SHA-256 (no salt, no stretching) suffices.
    return hashlib.sha256(token.encode()).hexdigest()


def display_prefix(token: str) -> str:
    return token[:10]
