"""The RL learner: GRPO on one-trace replay, SMD distillation, the papers' baselines, the loop."""

from kvstreams.train.config import Config, load_config

__all__ = ["Config", "load_config"]
