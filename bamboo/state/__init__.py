"""A node's training state between iterations: the layers it holds and the stages
and optimizers built from them, moving layers between nodes when the configuration
changes (handover, and the moves between epochs), checkpoints written to storage and
the checkpoint copies kept in host memory for a rollback. The runtime above it runs
iterations over that state; the agents read only where a redo can restart."""
