"""Testbed against the live A/B: clock and seq-adaptive over seq-protect per point, replayed
(replays.txt, from replay.sh) and live (the mean of the two runs per point in
../../apps-quick-policies-2026-11-29/summary.txt). Run from this directory."""
import math
import re
import statistics

NAMES = {"qs": "quicksort", "km": "kmeans", "lp": "linpack", "ml": "mlp"}
live = {}
for line in open("../../apps-quick-policies-2026-11-29/summary.txt"):
    m = re.match(r"(\w+)\s+(\d+) \| seq-protect\s+([\d.]+)s/\s*\d+M\s+([\d.]+)s/\s*\d+M \| seq-adaptive\s+([\d.]+)s/"
                 r"\s*\d+M\s+([\d.]+)s/\s*\d+M \| clock\s+([\d.]+)s/\s*\d+M\s+([\d.]+)s/\s*\d+M", line)
    if m:
        v = list(map(float, m.groups()[2:]))
        live[(m.group(1), int(m.group(2)))] = {"seq-protect": (v[0] + v[1]) / 2, "seq-adaptive": (v[2] + v[3]) / 2,
                                               "clock": (v[4] + v[5]) / 2}
replayed = {}
for line in open("replays.txt"):
    t, share, queue, *rest = line.split()
    replayed[(NAMES[t], int(share), int(queue))] = {x.split(":")[0]: float(x.split(":")[1]) for x in rest}
for queue in sorted({k[2] for k in replayed}):
    for policy in ("clock", "seq-adaptive"):
        sim_logs, live_logs, errors, right, differ = [], [], [], 0, 0
        for (w, share), times in sorted(live.items()):
            if (w, share, queue) not in replayed:
                continue
            s = replayed[(w, share, queue)]
            lr, sr = math.log(times[policy] / times["seq-protect"]), math.log(s[policy] / s["seq-protect"])
            live_logs.append(lr)
            sim_logs.append(sr)
            errors.append(abs(sr - lr))
            if abs(lr) > 0.05:
                differ += 1
                right += (lr > 0) == (sr > 0) and abs(sr) > 0.005
        q = replayed[("quicksort", 100, queue)]
        print(f"--clean-queue {queue:3} {policy:12}: replayed {math.exp(statistics.mean(sim_logs)):.3f}, "
              f"live {math.exp(statistics.mean(live_logs)):.3f} over {len(sim_logs)} points; mean |log error| "
              f"{statistics.mean(errors):.3f}; direction right on {right} of {differ} points live differs by > 5%; "
              f"quicksort at 100% {q[policy] / q['seq-protect']:.3f}")
