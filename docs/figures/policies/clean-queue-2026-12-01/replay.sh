#!/usr/bin/env bash
# Replays the quick programs' fault traces (recorded as in docs/policies.md, "A testbed of live
# fault traces", into /var/tmp/{qs,km,lp,ml}.tmtrace) at the budgets tiermem-file had live at
# 100/80/60/40/20% of each footprint, with cleaning ahead unlimited (0) or limited to 64 or 126
# write-backs in flight. One line per point: program, share, limit, then policy:modeled ms:
# evictions:evictions of cleaned pages.
set -euo pipefail
T=${TIERMEM:-target/release/tiermem}
declare -A budgets=([qs]="21633 17117 11758 7934 2830" [km]="58722 43497 31089 21759 7363"
                    [lp]="51652 38076 27218 18169 8102" [ml]="78717 57864 42511 29358 12845")
for t in qs km lp ml; do
  share=100
  for pages in ${budgets[$t]}; do
    for queue in 0 64 126; do
      "$T" sim "/var/tmp/$t.tmtrace" --local "$pages" --prefetch ondemand --replace seq-protect,clock,seq-adaptive \
        --monitor none --hits engine --read-ns 45000 --transfer-ns 11000 --fault-ns 5000 \
        --clean-ahead 0.3 --clean-queue "$queue" --json 2>/dev/null |
        python3 -c "import json, sys; d = json.load(sys.stdin); print('$t $share $queue', ' '.join('%s:%.1f:%d:%d' % (r['replace'], r['modeled_ns'] / 1e6, r['evictions'], r['cleaned_evictions']) for r in d['results']))"
    done
    share=$((share - 20))
  done
done
