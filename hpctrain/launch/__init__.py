"""Above training: Slurm submission, sweeps and preflight checks."""
