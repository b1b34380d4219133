"""Hooks: the capacity-probing hook across connections, and the Slurm connection type."""
