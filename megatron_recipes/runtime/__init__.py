"""Process groups, seeds and the CPU lane."""
