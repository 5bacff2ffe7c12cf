"""`idlegrid model`: prepare a researcher's model for training on the grid."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def model() -> None:
    """Prepare models for diloco-train (architecture hf-causal-lm)."""


@model.command("import-gguf")
@click.argument("source", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("folder", type=click.Path(path_type=Path, file_okay=False))
def import_gguf(source: Path, folder: Path) -> None:
    """Turn the GGUF file SOURCE into the Hugging Face FOLDER a training job takes
    (config.json, model.safetensors in float32, tokenizer.json). Needs the worker extra
    (transformers) and the gguf package."""
    from idlegrid.training import gguf_import, hf_models

    try:
        imported = gguf_import.to_folder(source, folder)
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install idlegrid[worker] and gguf") from None
    config = imported.config
    click.echo(
        f"{folder}/: {config['model_type']} model, {imported.parameters:,} parameters, "
        f"vocab {hf_models.vocab_size(config):,}, tokenizer "
        f"{'included' if imported.tokenizer else 'missing'}"
    )
