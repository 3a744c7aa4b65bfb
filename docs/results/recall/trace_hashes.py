import hashlib, sys, torch
torch.set_num_threads(1)
from kvstreams.models import load_model
from kvstreams.compaction import STRATEGIES, make_strategy
from kvstreams.policies import POLICIES, make_policy
from kvstreams.engine import RolloutEngine, SamplingParams
from kvstreams.episodes import EpisodeRunner
from kvstreams.envs import make_env
m, tok = load_model('/tmp/tinyq')
def h(traces):
    d = hashlib.sha256()
    for t in traces:
        for name in ("tokens","positions","death","sampled_mask","loss_mask","sampler_logprobs","weights_version"):
            x = getattr(t, name)
            d.update(name.encode()); d.update(x.contiguous().view(torch.uint8).numpy().tobytes() if x is not None else b"-")
        d.update(repr(sorted(t.metadata.items())).encode())
    return d.hexdigest()[:16]
out = {}
for s in sorted(STRATEGIES):
    for mode in ("stream", "reprefill"):
        r = EpisodeRunner(m, tok, make_strategy(s), mode=mode, sampling=SamplingParams(seed=0))
        res, _ = r.run([make_env("memory") for _ in range(2)], [1, 2])
        out[f"{s}/{mode}"] = h([t for x in res for t in x.traces])
r = EpisodeRunner(m, tok, None, mode="full", sampling=SamplingParams(seed=0))
res, _ = r.run([make_env("memory") for _ in range(2)], [1, 2]); out["full"] = h([t for x in res for t in x.traces])
r = EpisodeRunner(m, tok, make_strategy("markovian"), mode="stream", sampling=SamplingParams(seed=0), policy=make_policy("snapkv", budget=48, interval=4))
res, _ = r.run([make_env("memory") for _ in range(2)], [1, 2]); out["markovian+snapkv"] = h([t for x in res for t in x.traces])
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (40, 70, 25)]
for p in sorted(POLICIES):
    e = RolloutEngine(m, tok, make_policy(p, budget=48, interval=4) if p != "full" else make_policy("full"))
    out[f"policy/{p}"] = h(e.generate(prompts, SamplingParams(max_new_tokens=60, seed=1, stop_token_ids=())))
for k, v in out.items(): print(k, v)
