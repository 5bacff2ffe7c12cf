"""The `llm-generate` kind: a GGUF language model over prompts, through llama.cpp."""
