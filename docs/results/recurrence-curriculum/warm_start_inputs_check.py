"""Hash a seed-0 tiny model and 64 copying-expert demonstrations (docs/results.md 5c side finding):
run with two code versions on PYTHONPATH to compare the warm start's inputs."""
import sys, hashlib, torch, json
from pathlib import Path
torch.set_num_threads(1)
from kvstreams.tiny import make_tiny_model
from kvstreams.models import load_model
from kvstreams.train.sft import demonstrations
out = Path(sys.argv[1])
make_tiny_model(out, arch="qwen3", seed=0)
model, tok = load_model(str(out))
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(k.encode()); h.update(v.detach().numpy().tobytes())
print("weights", h.hexdigest()[:16])
d = demonstrations(tok, "memory", {"n_turns": 4, "n_facts": 1, "noise_words": 8, "expert_carries_state": False, "expert_copy_rate": 0.5}, 64, 0)
print("demos", hashlib.sha256(json.dumps([ (list(map(int,t)), list(map(bool,m))) for t, m in d]).encode()).hexdigest()[:16], len(d))
