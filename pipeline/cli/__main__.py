"""``python -m pipeline.cli``: what the ``ckpt`` script runs."""
import sys

from pipeline.cli.warm import main

sys.exit(main())
