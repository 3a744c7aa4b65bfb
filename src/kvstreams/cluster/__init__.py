"""Scale-out: the same run over Ray rollout workers and FSDP2 learner ranks (docs/scale-out.md).

``wire`` (what crosses processes), ``workers`` (rollout workers and their pool), ``fsdp`` (the
learner's ranks), ``launch`` (starting or joining Ray). Nothing here imports Ray at module level:
the single-process path never needs it.
"""
