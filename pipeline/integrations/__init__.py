"""Trainer integrations, each an optional extra: ``transformers`` (the HF Trainer) and ``lightning``.

Each declares a checkpoint complete when the trainer has written it (``pipeline.protect``),
so no layout marker or quiet period is needed, and can make the trainer's own deletion of
old checkpoints (``save_total_limit``, ``save_top_k``) wait until they are protected.
"""
