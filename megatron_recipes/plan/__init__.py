"""Layout planning without processes: rank -> group map, parameter/memory/step-time estimates, search, pictures."""
