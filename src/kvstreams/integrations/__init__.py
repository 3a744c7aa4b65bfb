"""kvstreams inside other trainers. :mod:`kvstreams.integrations.trl`: TRL's ``GRPOTrainer`` (the
``[trl]`` extra). verl and prime-rl are described on paper in ``docs/integrations.md``."""
