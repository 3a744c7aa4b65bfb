"""The figures of docs/results.md section 1d, recomputed from the stored runs:
python docs/results/smd-fixed/analysis.py > docs/results/smd-fixed/analysis.txt

Statistics (as pre-registered in section 1d):
- gain = eval/reward_mean after 100 steps minus before (64 held-out tasks x 4 samples, under the arm's
  own compression: SnapKV at most 224 entries per layer and KV head, compressing to 96 every 128);
  dense change = the same 256 episodes served without compression after training, minus the warm
  start's dense reward. The warm starts are smd-long's, bit for bit (same spec section and seeds; the
  start evaluations of seeds 2 and 3 equal the probes made on smd-long's stored models, checked
  below), so the warm start's dense reward is docs/results/smd-long/warm_start_dense.json.
- differences paired by seed; mean ± 95% Student-t interval over seeds (kvstreams.stats).
- per-step metrics (ESS, kept-token share, k3 KL): each run's mean over its steps, then mean ± t over
  seeds; "max over steps" where said.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from kvstreams.stats import mean_interval

HERE = Path(__file__).parent
KEY = "eval/reward_mean"
ARMS = ("shadow", "sparse-rl", "naive")


def load():
    runs = json.loads(gzip.decompress((HERE / "results.json.gz").read_bytes()))["runs"]
    by = {(r["arm"], r["seed"]): r for r in runs}
    probe = json.loads((HERE / "probes.json").read_text())["snapkv fixed 224/128"]["seeds"]
    for (arm, seed), r in by.items():  # the warm starts are smd-long's
        if str(seed) in probe:
            assert r["start"][KEY] == probe[str(seed)][KEY], (arm, seed)
    dense = json.loads((HERE.parent / "smd-long" / "warm_start_dense.json").read_text())
    return by, {int(k): v[KEY] for k, v in dense.items()}


def fmt(values) -> str:
    return mean_interval(values).text() + " (" + ", ".join(f"{v:+.3f}" for v in values) + ")"


def run_mean(run, key: str) -> float | None:
    values = [s[key] for s in run["steps"] if key in s]
    return sum(values) / len(values) if values else None


def run_max(run, key: str) -> float | None:
    values = [s[key] for s in run["steps"] if key in s]
    return max(values) if values else None


def print_run_means(by: dict, arm: str, seeds: list[int], keys) -> None:
    """Each per-step metric logged by every seed's run: the mean over seeds of the run's mean."""
    for key in keys:
        means = [run_mean(by[arm, s], key) for s in seeds]
        if None not in means:
            print(f"  {key}: mean over seeds of the run's mean {fmt(means)}")


def main() -> None:
    by, dense_start = load()
    seeds_of = {arm: sorted(s for a, s in by if a == arm) for arm in ARMS}
    gain, change = {}, {}
    print("## per arm (mean ± 95% t over seeds; per seed)")
    for arm in ARMS:
        seeds = seeds_of[arm]
        if not seeds:
            continue
        gain[arm] = {s: by[arm, s]["final"][KEY] - by[arm, s]["start"][KEY] for s in seeds}
        change[arm] = {s: by[arm, s]["evals"]["dense"][KEY] - dense_start[s] for s in seeds}
        print(f"{arm} seeds {seeds}")
        print(f"  start {fmt([by[arm, s]['start'][KEY] for s in seeds])}")
        print(f"  gain {fmt(list(gain[arm].values()))}")
        print(f"  dense change {fmt(list(change[arm].values()))}")
        print_run_means(
            by,
            arm,
            seeds,
            (
                "mismatch/ess",
                "correction/kept_token_frac",
                "correction/vetoed_seq_frac",
                "correction/band_rejected_token_frac",
                "mismatch/k3_kl",
                "clip/frac",
            ),
        )
        maxima = [run_max(by[arm, s], "mismatch/k3_kl") for s in seeds]
        if None not in maxima:
            print(f"  mismatch/k3_kl, max over all steps and seeds: {max(maxima):.3g}")
        minima = [
            min(st["mismatch/ess"] for st in by[arm, s]["steps"] if "mismatch/ess" in st) for s in seeds
        ]
        print(f"  mismatch/ess, min over all steps and seeds: {min(minima):.3g}")
    print("\n## training reward, steps 1-10 and 91-100 (mean over the steps), and the run's tied-group share")
    for arm in ARMS:
        for s in seeds_of[arm]:
            steps = [st for st in by[arm, s]["steps"] if "reward/mean" in st]
            first = sum(st["reward/mean"] for st in steps[:10]) / len(steps[:10])
            last = sum(st["reward/mean"] for st in steps[-10:]) / len(steps[-10:])
            tied = run_mean(by[arm, s], "rollout/zero_variance_group_frac")
            print(f"{arm} seed {s}: {first:.3f} -> {last:.3f}, rollout/zero_variance_group_frac {tied:.2f}")
    print("\n## paired (same seed)")
    for a, b in (("shadow", "sparse-rl"), ("shadow", "naive"), ("sparse-rl", "naive")):
        seeds = sorted(set(gain.get(a, {})) & set(gain.get(b, {})))
        if seeds:
            print(f"{a} - {b}, seeds {seeds}:")
            print(f"  gain {fmt([gain[a][s] - gain[b][s] for s in seeds])}")
            print(f"  dense change {fmt([change[a][s] - change[b][s] for s in seeds])}")


if __name__ == "__main__":
    main()
