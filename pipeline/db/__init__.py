"""The control plane: models, engines, migrations and the one transition function."""
