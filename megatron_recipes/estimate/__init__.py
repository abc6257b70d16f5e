"""The one cost model of a run, computed without processes: rank -> group map (megatron-core's
RankGenerator), exact parameter counts, FLOPs per token (plan's and the trainer's MFU), memory,
activations, sharding, pipeline schedule and step time. Imports ``config`` only: the rule table
(``validation``) and the ``plan`` command build on it."""
