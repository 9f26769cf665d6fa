"""``ckpt``: the command line (parser and entry point in :mod:`pipeline.cli.main`)."""
from pipeline.cli.main import main

__all__ = ["main"]
