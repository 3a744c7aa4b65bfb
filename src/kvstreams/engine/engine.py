"""``RolloutEngine``: a single-turn front of :class:`~kvstreams.engine.stream.StreamSession`, which samples.

It keeps what a caller with bare prompts holds between batches (the model, tokenizer, policy, weights
version and the last batch's :class:`~kvstreams.engine.stream.GenerationStats`); each
:meth:`RolloutEngine.generate` is one session (:meth:`StreamSession.for_prompts`, then
:meth:`StreamSession.generate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvstreams.engine.stream import GenerationStats, StreamSession
from kvstreams.models import check_attention
from kvstreams.policies import EvictionPolicy, make_policy
from kvstreams.sampling import SamplingParams
from kvstreams.trace import Trace


class RolloutEngine:
    """Samples batches of sequences from an HF causal LM with a budget-bounded, in-place KV cache.

    >>> engine = RolloutEngine(model, tokenizer, make_policy("snapkv", budget=0.5))
    >>> traces = engine.generate(prompts, SamplingParams(max_new_tokens=256, seed=0))
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        policy: EvictionPolicy | None = None,
        model_name: str = "",
        weights_version: int = 0,
    ) -> None:
        check_attention(model)
        self.model, self.tokenizer = model, tokenizer
        self.policy = policy or make_policy("full")
        self.model_name = model_name or str(getattr(model.config, "_name_or_path", ""))
        self.weights_version = weights_version  # the weights version; every sampled token records it
        self.last_stats = GenerationStats()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights in place; tokens sampled from now on record ``version``."""
        self.model.load_state_dict(state_dict, strict=True)
        self.weights_version = version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int], None] | None = None,
        on_step: Callable[[int, StreamSession], None] | None = None,
    ) -> list[Trace]:
        """One :class:`Trace` per prompt, in order (:meth:`StreamSession.generate`; ``on_step(n, target)``
        gets the running session as the target of mid-generation weight updates)."""
        session = StreamSession.for_prompts(self.model, prompts, params, self.policy, self.weights_version)
        try:
            traces = session.generate(self.tokenizer, self.model_name, progress, on_step)
        finally:
            self.weights_version = session.weights_version  # on_step may have loaded newer weights
        self.last_stats = session.stats
        return traces
