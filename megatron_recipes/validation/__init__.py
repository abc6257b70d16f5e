"""The one rule table (``rules_*.py``, assembled in ``rules.py``) and ``validate``, which runs it over a
composed recipe. Imports ``config`` and the cost model (``estimate``), nothing that runs a model."""
