"""Byte-grouped compression of tensor data (docs/design.md, "Byte-grouped compression").

:mod:`~pipeline.codec.segments` says which bytes of a safetensors range hold which dtype,
:mod:`~pipeline.codec.planes` splits elements into byte planes and back, and
:mod:`~pipeline.codec.frames` writes and reads the self-describing frames, one per block.
"""
