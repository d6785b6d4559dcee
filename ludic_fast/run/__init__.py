"""The run's infrastructure: checkpoints, loggers, stats, atomic files, run warnings."""
