"""Finding checkpoints: roots and runs, completeness, hashing, recording, the watcher."""
