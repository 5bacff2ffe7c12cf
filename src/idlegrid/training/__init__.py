"""DiLoCo training: rounds of H local steps per worker, one compressed update per round.

Coordinator side, numpy only (no torch): `flat` (named tensors <-> one float32 vector,
safetensors I/O), `compression`, `outer` (Nesterov outer optimizer, the update both sides
apply), `aggregate` (mean and robust rules), `rounds` (closing one round), `tasks` (task
payload and result bytes), `verify` (comparing replicas), `corpus` and `data` (what is
trained on), `models` (architectures' parameter lists and seeded init).

Worker side, torch imported inside functions: `inner` (H AdamW steps), `torch_modules`,
`worker` (one task end to end), `worker_state` (caches between tasks). `simulate` runs
DiLoCo against synchronous data-parallel training in one process.
"""
