#!/bin/bash
# Fixed-seed comparison of two checkouts (e.g. before and after a refactor): train 3 steps in stream and
# re-prefill mode and two rollouts in each, then compare metrics (but wall-clock) and traces.
# Usage: scripts/compare_fixed_seed.sh OLD_CHECKOUT NEW_CHECKOUT   (the NEW one's .venv runs both)
set -e
OLD=$(realpath "$1"); NEW=$(realpath "$2"); PY=$NEW/.venv/bin
rm -rf /tmp/cmp; mkdir -p /tmp/cmp
$PY/python -c "from kvstreams.tiny import make_tiny_model; make_tiny_model('/tmp/cmp/model', arch='qwen3')" > /dev/null 2>&1
for pair in frozen:$OLD main:$NEW; do
  tree=${pair%%:*}; dir=${pair#*:}
  cd $dir
  for mode in stream reprefill; do
    loss=shadow; [ $mode = reprefill ] && loss=reprefill
    OMP_NUM_THREADS=1 PYTHONPATH=$dir/src $PY/kvstreams train --set model.path=/tmp/cmp/model \
      --set rollout.env=memory '--set=rollout.env_args={n_turns = 4, n_facts = 1, noise_words = 8}' --set rollout.strategy=markovian \
      --set rollout.mode=$mode --set loss.type=$loss --set rollout.prompts_per_step=2 --set rollout.group_size=4 --set rollout.max_reply_tokens=16 \
      --set train.steps=3 --set train.eval_every=3 --set train.eval_episodes=4 --set train.eval_samples=2 --set train.plots=false \
      --set train.out_dir=/tmp/cmp/$tree-train-$mode > /tmp/cmp/$tree-train-$mode.log 2>&1
  done
  OMP_NUM_THREADS=1 PYTHONPATH=$dir/src $PY/kvstreams rollout --model /tmp/cmp/model --strategy markovian --compact-budget 160 \
    --policy snapkv --episodes 3 --max-reply-tokens 16 --out /tmp/cmp/$tree-rollout > /tmp/cmp/$tree-rollout.log 2>&1
  OMP_NUM_THREADS=1 PYTHONPATH=$dir/src $PY/kvstreams rollout --model /tmp/cmp/model --policy h2o --episodes 3 \
    --max-new-tokens 40 --prompt-len 32 --out /tmp/cmp/$tree-rollout-policy > /tmp/cmp/$tree-rollout-policy.log 2>&1
done
$PY/python - <<'PY'
import json, glob
from pathlib import Path
import torch
from kvstreams.trace import Trace
def rows(p):
    out=[]
    for line in Path(p).read_text().splitlines():
        r=json.loads(line); out.append({k:v for k,v in r.items() if not any(w in k for w in ("seconds","tokens/s","time/"))})
    return out
for mode in ("stream","reprefill"):
    a=rows(f"/tmp/cmp/frozen-train-{mode}/metrics.jsonl"); b=rows(f"/tmp/cmp/main-train-{mode}/metrics.jsonl")
    diff=[(i,k) for i,(x,y) in enumerate(zip(a,b)) for k in set(x)|set(y) if x.get(k)!=y.get(k)]
    print(f"train {mode}: {len(a)} vs {len(b)} metric rows, {sum(len(x) for x in a)} figures; differing figures: {diff[:10]}")
for d in ("rollout","rollout-policy"):
    fa=sorted(glob.glob(f"/tmp/cmp/frozen-{d}/*.safetensors")); fb=sorted(glob.glob(f"/tmp/cmp/main-{d}/*.safetensors"))
    same=0; metadiff=set()
    for x,y in zip(fa,fb,strict=True):
        tx,ty=Trace.load(x),Trace.load(y)
        ok=all(torch.equal(torch.nan_to_num(getattr(tx,n).float(),nan=-999.0),torch.nan_to_num(getattr(ty,n).float(),nan=-999.0)) for n in ("tokens","positions","death","sampler_logprobs","sampled_mask","loss_mask"))
        same+=ok
        metadiff|={k for k in set(tx.metadata)|set(ty.metadata) if tx.metadata.get(k)!=ty.metadata.get(k)}
    print(f"{d}: {len(fa)} traces, {same} with identical tokens/death/logprobs/mask; metadata keys differing: {sorted(metadiff)}")
    sa=json.loads(Path(f"/tmp/cmp/frozen-{d}/summary.json").read_text()); sb=json.loads(Path(f"/tmp/cmp/main-{d}/summary.json").read_text())
    print(f"  summary keys differing: {sorted(k for k in set(sa)|set(sb) if sa.get(k)!=sb.get(k))}")
PY
