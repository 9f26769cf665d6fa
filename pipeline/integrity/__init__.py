"""Integrity over time: scrub, repair, and reconciling a worker that came back."""
