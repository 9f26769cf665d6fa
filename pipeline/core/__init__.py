"""Pure rules and formats: no I/O, no database (tests/unit/test_layout.py keeps them so)."""
