"""CLI options shared by several commands, declared once."""
from typing import Annotated, Optional

import typer

ModelOption = Annotated[Optional[str], typer.Option(
    "--model", help="Local HF model dir or .gguf file (default: the embedded SmolLM2-135M-Instruct).")]
DeviceOption = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
