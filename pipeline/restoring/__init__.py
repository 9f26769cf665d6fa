"""Giving checkpoints back: restore jobs, rebuilding files, fetching shards, load_state_dict."""
