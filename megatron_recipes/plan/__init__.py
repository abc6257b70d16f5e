"""The ``plan`` command: a recipe's layout, groups, memory and step time (from ``estimate``) with its
verdict (from ``validation``), the layout search, the report and the picture."""
