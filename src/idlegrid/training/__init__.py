"""The DiLoCo math library, used by `kinds/diloco` and, through that kind, the coordinator.

Numpy only (the coordinator closes rounds without torch): `flat` (named tensors <-> one
float32 vector, safetensors I/O), `compression`, `outer` (Nesterov outer optimizer, the
update both sides apply), `aggregate` (mean and robust rules), `closing` (closing one
round), `fragments` (streaming DiLoCo's blocks of layers), `verify` (comparing
replicas), `schedule` (when a round closes), `models` (architectures' parameter lists
and seeded init). `torch_modules` holds the architectures' torch modules, imported by
`models.build_module` alone.

The kind's own code lives in `idlegrid.kinds.diloco`: task payload and result bytes
(`tasks`), what is trained on (`data`, `char_corpus`), the worker side (`inner`: H
AdamW steps, `run`: one task end to end, `worker_state`, `task_checkpoint`). DiLoCo
played in one process is an experiment outside the package: benchmarks/diloco_simulate.py
and benchmarks/diloco_timeline.py.
"""
