"""A run's config and directory: Hydra composition, resolution and checks, the run directory."""
