"""embed-text through ONNX Runtime: the packaged weights exported once, cached by hash,
agreeing with the torch path under the kind's own compare."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from idlegrid.kinds.base import RunContext, Verdict
from idlegrid.kinds.embed_text import onnx as embed_onnx
from idlegrid.kinds.embed_text.kind import (
    EmbedTextKind,
    EmbedTextParams,
    embed_reference,
    parse_embeddings,
    row_cosines,
    texts_to_jsonl,
)
from idlegrid.kinds.embed_text.samples import stdlib_paragraphs
from idlegrid.kinds.onnx.examples import mean_pooled
from idlegrid.kinds.onnx.kind import OnnxInferKind

KIND = EmbedTextKind()


def test_the_onnx_runtime_needs_a_node_with_onnx_runtime() -> None:
    assert KIND.requirements(EmbedTextParams()).onnx_providers == frozenset()
    needs = KIND.requirements(EmbedTextParams(runtime="onnx"))
    assert "CPUExecutionProvider" in needs.onnx_providers


@pytest.mark.slow
def test_onnx_export_agrees_with_torch_and_is_cached_by_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDLEGRID_ONNX_CACHE", str(tmp_path))
    monkeypatch.setattr(embed_onnx, "_encoders", {})
    texts = stdlib_paragraphs(48) + ["a", "word " * 400]  # short, truncated
    outputs = {}
    for runtime in ("torch", "onnx"):
        params = EmbedTextParams(shard_size=64, batch_size=16, runtime=runtime)
        shard = KIND.split({"texts": texts_to_jsonl(texts)}, params)[0]
        outputs[runtime] = KIND.run(shard.payload, params, RunContext(threads=2))
        KIND.check_output(shard.payload, outputs[runtime], params)
    exported = list(tmp_path.glob("minilm-*.onnx"))
    assert len(exported) == 1 and exported[0] == embed_onnx.exported_model()
    assert KIND.compare(outputs["torch"], outputs["onnx"], EmbedTextParams()) is Verdict.AGREE
    torch_rows, onnx_rows = parse_embeddings(outputs["torch"]), parse_embeddings(outputs["onnx"])
    assert float(row_cosines(torch_rows, onnx_rows).min()) > 1 - 1e-9
    # The export is a standard-ops model a researcher could submit to onnx-infer as well.
    facts = OnnxInferKind().derive_params(
        {"model": exported[0].read_bytes()}, OnnxInferKind().parse_params({})
    )
    assert facts.model_facts is not None  # type: ignore[attr-defined]
    # With mean pooling in its graph it is a sentence encoder, sentence-transformers' rows
    # (before normalising) from one ONNX Runtime run, and still a model onnx-infer accepts.
    pooled = mean_pooled(exported[0].read_bytes())
    assert OnnxInferKind().derive_params({"model": pooled}, OnnxInferKind().parse_params({}))
    encoded = embed_onnx.tokenizer().encode_batch(texts)  # as the kind's: 256 tokens at most
    ids = np.array([row.ids for row in encoded], np.int64)
    session = ort.InferenceSession(pooled, providers=["CPUExecutionProvider"])
    (rows,) = session.run(
        ["embedding"],
        {
            "input_ids": ids,
            "attention_mask": np.array([row.attention_mask for row in encoded], np.int64),
            "token_type_ids": np.zeros_like(ids),
        },
    )
    reference = embed_reference(texts, normalize=False)
    assert np.allclose(rows, reference, rtol=0, atol=1e-4)  # they differ by about 1e-6
