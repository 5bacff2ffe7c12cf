"""The built-in architectures: parameter lists that match the torch modules, seeded init."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_python
from pydantic import ValidationError

from idlegrid.training import models

CONFIGS = {
    "mlp": {"inputs": 12, "hidden": [16, 8], "classes": 3},
    "cnn": {"channels": 2, "image_size": 8, "width": 4, "classes": 5},
    "transformer-lm": {"vocab": 20, "context": 16, "width": 16, "layers": 2, "heads": 2},
}


def test_every_architecture_is_tested() -> None:
    # hf-causal-lm's tensors are checked against transformers in test_hf_models.py.
    assert set(models.ARCHITECTURES) == {*CONFIGS, "hf-causal-lm"}


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_parameter_list_matches_the_torch_module(architecture: str) -> None:
    pytest.importorskip("torch")
    config = models.parse_config(architecture, CONFIGS[architecture])
    module = models.build_module(architecture, config)
    named = [(name, tuple(p.shape)) for name, p in module.named_parameters()]
    assert named == list(models.flat_spec(architecture, config).entries)
    assert not list(module.buffers())


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_forward_shapes(architecture: str) -> None:
    torch = pytest.importorskip("torch")
    from idlegrid.kinds.diloco.inner import load_module

    config = models.parse_config(architecture, CONFIGS[architecture])
    weights = models.init_weights(architecture, config, seed=1)
    module = load_module(architecture, config, weights, "cpu")
    if architecture == "transformer-lm":
        out = module(torch.zeros(3, 16, dtype=torch.long))
        assert out.shape == (3, 16, 20)
    elif architecture == "cnn":
        assert module(torch.zeros(3, 2, 8, 8)).shape == (3, 5)
    else:
        assert module(torch.zeros(3, 12)).shape == (3, 3)


def test_init_is_seeded_and_follows_the_parameter_list() -> None:
    config = models.parse_config("transformer-lm", CONFIGS["transformer-lm"])
    first = models.init_weights("transformer-lm", config, seed=3)
    assert np.array_equal(first, models.init_weights("transformer-lm", config, seed=3))
    assert not np.array_equal(first, models.init_weights("transformer-lm", config, seed=4))
    assert first.dtype == np.float32 and first.size == models.parameter_count(
        "transformer-lm", config
    )
    from idlegrid.training.flat import unflatten

    named = unflatten(first, models.flat_spec("transformer-lm", config))
    assert np.all(named["norm.weight"] == 1) and np.all(named["head.bias"] == 0)
    assert named["tokens.weight"].std() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize(
    ("architecture", "config"),
    [("transformer-lm", {"width": 30, "heads": 4}), ("mlp", {"depth": 3}), ("gpt-5", {})],
)
def test_bad_configs_are_refused(architecture: str, config: dict[str, object]) -> None:
    with pytest.raises((ValidationError, ValueError)):
        models.parse_config(architecture, config)


def test_parameter_lists_and_init_need_no_torch() -> None:
    code = (
        "import sys; from idlegrid.training import models; "
        "c = models.parse_config('cnn', {}); models.init_weights('cnn', c, 0); "
        "assert 'torch' not in sys.modules"
    )
    run_python(code, timeout_s=60)
