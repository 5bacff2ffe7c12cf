"""`idlegrid model`: prepare a researcher's model for training on the grid."""

from __future__ import annotations

from pathlib import Path

import click

from idlegrid.training.gguf_export import DEFAULT_TYPE, TYPES


@click.group()
def model() -> None:
    """Prepare models for diloco-train (architecture hf-causal-lm), and serve what it
    trained with llm-generate."""


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


@model.command("export-gguf")
@click.argument("folder", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("output", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--type",
    "quantization",
    type=click.Choice(TYPES, case_sensitive=False),
    default=DEFAULT_TYPE,
    show_default=True,
    help="Tensor type: f32, f16, bf16 and q8_0 are written directly; the others by "
    "llama.cpp's quantizer (needs llama-cpp-python, the worker extra).",
)
@click.option(
    "--base",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="For a LoRA adapter folder: the base model's folder (default: the one its "
    "adapter_config.json names).",
)
def export_gguf(folder: Path, output: Path, quantization: str, base: Path | None) -> None:
    """Write the model FOLDER (a trained result: a model folder, or a LoRA adapter folder
    merged into its base) as the GGUF file OUTPUT, which llm-generate and llama.cpp run.

    \b
    idlegrid model export-gguf SmolLM2-tuned/ SmolLM2-tuned.gguf            # q8_0
    idlegrid model export-gguf SmolLM2-tuned/ SmolLM2-tuned.gguf --type q4_k_m
    idlegrid submit llm-generate SmolLM2-tuned.gguf prompts.jsonl -o out.jsonl
    """
    from idlegrid.training import gguf_export, hf_folder

    try:
        done = gguf_export.export(folder, output, quantization=quantization.lower(), base=base)
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install idlegrid[worker]") from None
    except (gguf_export.ExportError, hf_folder.ModelError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"{done.path}: {done.architecture}, {done.quantization}, tokenizer {done.tokenizer}, "
        f"{done.size / 1e6:,.1f} MB"
    )
