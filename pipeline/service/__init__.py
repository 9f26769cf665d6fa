"""The long-running processes: the scheduler, the supervisor of `ckpt up`, HTTP serving."""
