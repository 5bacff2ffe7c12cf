"""Small ONNX models and images made in code: for tests, the demo and the benchmarks.

Nothing can be downloaded at run time, so the project builds its own models with
`onnx.helper` (seeded weights) and draws its own images with Pillow. `mlp` is a dense
network over feature rows, `conv_net` an image classifier with an embedding head;
`layers` lets a test build the "cheaper" model a cheat would run instead. `mean_pooled`
turns an exported text encoder (all-MiniLM-L6-v2's, `embed_onnx.exported_model`) into a
sentence encoder, as a researcher would bring one.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from onnx import GraphProto, NodeProto, TensorProto

OPSET = 17


def mlp(
    *, features: int = 32, hidden: int = 64, outputs: int = 16, layers: int = 3, seed: int = 0
) -> bytes:
    """A dense ReLU network: input "x" (rows, features) float32 -> "y" (rows, outputs)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    nodes, weights = [], []
    width, current = features, "x"
    for layer in range(layers):
        out_width = outputs if layer == layers - 1 else hidden
        w = (rng.standard_normal((width, out_width)) / np.sqrt(width)).astype(np.float32)
        b = (rng.standard_normal(out_width) * 0.1).astype(np.float32)
        weights += [_tensor(f"w{layer}", w), _tensor(f"b{layer}", b)]
        name = "y" if layer == layers - 1 else f"h{layer}"
        gemm = f"g{layer}" if layer < layers - 1 else name
        nodes.append(helper.make_node("Gemm", [current, f"w{layer}", f"b{layer}"], [gemm]))
        if layer < layers - 1:
            nodes.append(helper.make_node("Relu", [gemm], [name]))
        width, current = out_width, name
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", outputs])],
        initializer=weights,
    )
    return _model(graph)


def conv_net(
    *, size: int = 32, channels: int = 8, classes: int = 10, embedding: int = 32, seed: int = 0
) -> bytes:
    """An image network: "image" (rows, 3, size, size) float32 -> "logits" (rows, classes),
    "embedding" (rows, embedding) and "label" (rows,) int64 (the argmax)."""
    from onnx import TensorProto, helper

    initializers = _conv_net_weights(
        channels=channels, classes=classes, embedding=embedding, seed=seed
    )
    nodes = _conv_net_nodes()
    graph = helper.make_graph(
        nodes,
        "conv_net",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["rows", 3, size, size])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", classes]),
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["rows", embedding]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["rows"]),
        ],
        initializer=initializers,
    )
    return _model(graph)


def _conv_net_weights(
    *, channels: int, classes: int, embedding: int, seed: int
) -> list[TensorProto]:
    """`conv_net`'s seeded weights and biases: two convolutions, the embedding, the head."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> TensorProto:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        return _tensor(name, (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32))

    def bias(name: str, width: int) -> TensorProto:
        return _tensor(name, (rng.standard_normal(width) * 0.05).astype(np.float32))

    return [
        weight("c1", channels, 3, 3, 3),
        bias("cb1", channels),
        weight("c2", 2 * channels, channels, 3, 3),
        bias("cb2", 2 * channels),
        weight("fe", 2 * channels, embedding),
        bias("feb", embedding),
        weight("fc", embedding, classes),
        bias("fcb", classes),
    ]


def _conv_net_nodes() -> list[NodeProto]:
    """`conv_net`'s layers: conv, pool, conv, global pool, embedding, logits and argmax."""
    from onnx import helper

    return [
        helper.make_node("Conv", ["image", "c1", "cb1"], ["a1"], pads=[1] * 4, kernel_shape=[3, 3]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "c2", "cb2"], ["a2"], pads=[1] * 4, kernel_shape=[3, 3]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fe", "feb"], ["embedding"]),
        helper.make_node("Relu", ["embedding"], ["er"]),
        helper.make_node("Gemm", ["er", "fc", "fcb"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]


def mean_pooled(encoder: bytes, *, width: int = 384) -> bytes:
    """A transformer encoder (opset 13 or newer, inputs including "attention_mask", first
    output the hidden states, (rows, tokens, width)) with sentence-transformers' mean
    pooling added to its graph: one output, "embedding" (rows, width), the mean of the
    real tokens' states."""
    from onnx import TensorProto, checker, helper, load_from_string

    model = load_from_string(encoder)
    graph = model.graph
    hidden = graph.output[0].name
    graph.initializer.extend(
        [
            _tensor("pool_tokens_axis", np.array([1], np.int64)),
            _tensor("pool_width_axis", np.array([2], np.int64)),
            _tensor("pool_least", np.array(1e-9, np.float32)),  # an all-padding row: zeros
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Cast", ["attention_mask"], ["pool_mask"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["pool_mask", "pool_width_axis"], ["pool_mask3"]),
            helper.make_node("Mul", [hidden, "pool_mask3"], ["pool_masked"]),
            helper.make_node(
                "ReduceSum", ["pool_masked", "pool_tokens_axis"], ["pool_sum"], keepdims=0
            ),
            helper.make_node(
                "ReduceSum", ["pool_mask3", "pool_tokens_axis"], ["pool_count"], keepdims=0
            ),
            helper.make_node("Max", ["pool_count", "pool_least"], ["pool_divisor"]),
            helper.make_node("Div", ["pool_sum", "pool_divisor"], ["embedding"]),
        ]
    )
    del graph.output[:]
    graph.output.append(
        helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["rows", width])
    )
    checker.check_model(model)
    return bytes(model.SerializeToString())


def _tensor(name: str, array: np.ndarray) -> TensorProto:
    from onnx import numpy_helper

    return numpy_helper.from_array(array, name)


def _model(graph: GraphProto) -> bytes:
    from onnx import checker, helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8  # loadable by every ONNX Runtime of the last few years
    checker.check_model(model)
    return bytes(model.SerializeToString())


def images(count: int, *, size: int = 48, seed: int = 0, kind: str = "PNG") -> list[bytes]:
    """`count` distinct drawn images (shapes and gradients), encoded as PNG or JPEG."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    encoded = []
    for _ in range(count):
        y, x = np.mgrid[0:size, 0:size]
        base = rng.uniform(0, 255, 3)
        slope = rng.uniform(-3, 3, (2, 3))
        pixels = base + x[..., None] * slope[0] + y[..., None] * slope[1]
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
        draw = ImageDraw.Draw(image)
        for _ in range(3):
            x0, y0 = rng.integers(0, size - 8, 2)
            box = [int(x0), int(y0), int(x0 + rng.integers(4, 20)), int(y0 + rng.integers(4, 20))]
            draw.ellipse(box, fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
        buffer = io.BytesIO()
        image.save(buffer, format=kind)
        encoded.append(buffer.getvalue())
    return encoded


def zip_images(blobs: Sequence[bytes], *, names: Sequence[str] | None = None) -> bytes:
    """A zip of the images, named so that name order is list order (or `names`)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for index, blob in enumerate(blobs):
            suffix = ".jpg" if blob.startswith(b"\xff\xd8") else ".png"
            name = names[index] if names is not None else f"{index:06d}{suffix}"
            archive.writestr(name, blob)
    return buffer.getvalue()


IMAGENET_PREPROCESS = {
    "crop": (32, 32),
    "resize": 36,
    "mean": (0.485, 0.456, 0.406),
    "std": (0.229, 0.224, 0.225),
    "layout": "NCHW",
}
