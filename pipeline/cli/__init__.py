"""``ckpt``: the command line.

The ``ckpt`` script is :func:`pipeline.cli.warm.main`: a command ``ckpt up``'s command server can
run is handed to it (its imports already done), any other runs in its own process through
:func:`pipeline.cli.main.main`, the parser. Importing this package imports nothing, so that a
warm command starts in a few hundredths of a second.
"""
