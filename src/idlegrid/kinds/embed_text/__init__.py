"""The embed-text kind: sentence embeddings with all-MiniLM-L6-v2, on torch or ONNX Runtime."""
