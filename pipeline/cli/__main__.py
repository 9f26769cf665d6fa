"""``python -m pipeline.cli``: what the ``ckpt`` script runs."""
import sys

from pipeline.cli.main import main

sys.exit(main())
