"""The coordinator's side of an `hf-causal-lm` job's inputs: its model, its text, round 0.

A job of a researcher's model takes two inputs: `model` (`training.hf_folder`'s container
of config, weights and tokenizer) and `dataset` (token ids as for the built-in models, or
UTF-8 text, `text_dataset_blob`, which the model's tokenizer turns into ids here). Every
problem is an InputError naming it, at submission: the config, a tensor, the tokenizer,
a token id at or above the vocabulary, the job's size limit. Numpy and tokenizers only.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from idlegrid.blobs.files import input_hash
from idlegrid.kinds.base import InputError
from idlegrid.kinds.diloco import data as datasets
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.dataset import read_dataset
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.training import hf_folder, hf_models, models
from idlegrid.training.flat import ContainerError, pack, unpack

ARCHITECTURE = "hf-causal-lm"
# Models and token streams lately read: the round driver reads a job's inputs again.
_CACHE_SIZE = 2
_models: OrderedDict[str, hf_folder.HFModel] = OrderedDict()
_token_streams: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
_lock = threading.Lock()


def is_hf(params: DilocoParams) -> bool:
    return params.architecture == ARCHITECTURE


def derive(params: DilocoParams, inputs: Mapping[str, bytes]) -> DilocoParams:
    """The job's settings with its model's config and blob hash filled in from `model`."""
    if not is_hf(params):
        if "model" in inputs:
            raise InputError(f"input 'model' is for architecture {ARCHITECTURE!r}, "
                             f"not {params.architecture!r}")  # fmt: skip
        return params
    settings = params.model_settings()
    model = read_model(inputs, settings.max_parameters)
    context = hf_models.context_length(model.config)
    if params.inner.seq_len > context:
        raise InputError(f"inner.seq_len {params.inner.seq_len} exceeds the model's context "
                         f"{context} (max_position_embeddings)")  # fmt: skip
    raw = {**params.model, "config": model.config, "base": input_hash(inputs, "model")}
    try:
        return DilocoParams.model_validate({**params.model_dump(), "model": raw})
    except ValueError as exc:
        raise InputError(str(exc)) from None


def read_model(inputs: Mapping[str, bytes], max_parameters: int) -> hf_folder.HFModel:
    """The checked model of the `model` input (read once per blob while cached)."""
    if "model" not in inputs:
        raise InputError(f"architecture {ARCHITECTURE!r} needs the input 'model' "
                         "(a Hugging Face folder; see docs/training.md)")  # fmt: skip
    key = input_hash(inputs, "model")
    with _lock:
        held = _models.get(key)
    if held is not None and held.parameters <= max_parameters:
        return held
    try:
        model = hf_folder.read_model_blob(inputs["model"], max_parameters=max_parameters)
    except hf_folder.ModelError as exc:
        raise InputError(str(exc)) from None
    _remember(_models, key, model)
    return model


def initial_weights(params: DilocoParams, inputs: Mapping[str, bytes] | None) -> np.ndarray:
    """Round 0's weights: drawn from the seed, or the `model` input's (full training)."""
    settings = params.model_settings()
    if models.seeded(params.architecture, settings):
        return models.init_weights(params.architecture, settings, params.seed)
    if inputs is None:
        raise InputError(
            f"{ARCHITECTURE} starts from its model input: run it with the round driver"
        )
    model = read_model(inputs, settings.max_parameters)
    return hf_folder.flat_weights(model)


def training_data(
    params: DilocoParams, inputs: Mapping[str, bytes]
) -> tuple[tasks.DataRef, tasks.DataRef]:
    """The training and held-out data; text tokenized, ids checked against the vocabulary."""
    if "dataset" not in inputs:
        raise InputError("missing input 'dataset' (safetensors)")
    blob = inputs["dataset"]
    if not is_hf(params):
        return read_dataset(blob)
    config = params.model_settings().config
    tokens = _text_tokens(params, inputs, blob)
    train, held_out = read_dataset(blob if tokens is None else pack({"tokens": tokens}, {}))
    for part in (train, held_out):
        _check_ids(tasks.load_data(part), config)
    return train, held_out


def _text_tokens(
    params: DilocoParams, inputs: Mapping[str, bytes], blob: bytes
) -> np.ndarray | None:
    try:
        arrays, _ = unpack(blob)
    except ContainerError as exc:
        raise InputError(f"dataset: {exc}") from None
    if hf_folder.TEXT_ARRAY not in arrays:
        return None
    model = read_model(inputs, params.model_settings().max_parameters)
    if model.tokenizer is None:
        raise InputError("dataset is text, and the model folder has no tokenizer.json")
    key = (input_hash(inputs, "model"), hashlib.sha256(blob).hexdigest())
    with _lock:
        held = _token_streams.get(key)
    if held is not None:
        return held
    try:
        text = arrays[hf_folder.TEXT_ARRAY].tobytes().decode("utf-8")
        tokens = hf_folder.tokenize(model.tokenizer, text)
    except UnicodeDecodeError as exc:
        raise InputError(f"dataset: text is not UTF-8 ({exc})") from None
    except hf_folder.ModelError as exc:
        raise InputError(str(exc)) from None
    _remember(_token_streams, key, tokens)
    return tokens


def _check_ids(data: datasets.Dataset, config: Mapping[str, object]) -> None:
    if not isinstance(data, datasets.TokenData):
        raise InputError(f"dataset: {ARCHITECTURE} trains on token ids or text, not examples")
    vocab = hf_models.vocab_size(config)
    if len(data) and int(data.tokens.max()) >= vocab:
        raise InputError(f"dataset: token id {int(data.tokens.max())} is at or above the "
                         f"model's vocab_size {vocab}")  # fmt: skip


def _remember(cache: OrderedDict, key: object, value: object) -> None:  # type: ignore[type-arg]
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)


def memory_need_mb(params: DilocoParams) -> int:
    """Memory a node needs for one task: the model, its trained values' optimizer state
    and the activations of one micro-batch (`hf_models.memory_need_mb`)."""
    settings = params.model_settings()
    assert isinstance(settings, models.HFConfig)
    trainable = models.parameter_count(params.architecture, settings)
    kept = 2 * trainable if params.inner.keep_state else 0
    need = hf_models.memory_need_mb(
        settings.config, trainable=trainable + kept, micro_batch=params.inner.micro_batch,
        seq_len=params.inner.seq_len, checkpointing=settings.gradient_checkpointing,
    )  # fmt: skip
    return need
