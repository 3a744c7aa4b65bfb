"""kvstreams: RL post-training of long-context LLM agents with in-place KV eviction and exact replay.

Data flow: environment -> engine (+ eviction policy) -> trace -> replay -> loss -> optimizer.
"""

__version__ = "0.1.0"
