"""The onnx-infer kind: a researcher's ONNX graph over a dataset, on ONNX Runtime."""
