"""In-container entry points that srun (or a user on a single node) calls."""
