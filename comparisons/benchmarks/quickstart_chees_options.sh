#!/bin/bash
# The quickstart's chees reference under three option sets, seeds 0-3, both datasets, one after the
# other (issue 41): A = quickstart.toml as it is; B = + trajectory_adaptation "ceiling" and
# warmup_trajectory_scale 0.5; C = B + target_accept_prob 0.75 (the options that put chees at parity
# with BlackJAX on the benchmark BNN, docs/benchmarks/chees.md). Prints each cell's gradients, CPU s
# and certification.
#
#   bash comparisons/benchmarks/quickstart_chees_options.sh [OUT_DIR]   (from the repository root)
set -euo pipefail
OUT=${1:-/tmp/quickstart_chees_options}
mkdir -p "$OUT"
python - "$OUT" <<'PY'
import sys
out = sys.argv[1]
src = open("comparisons/quickstart.toml").read().replace("seeds = [0]", "seeds = [0, 1, 2, 3]")
head = next(line for line in src.splitlines() if line.startswith("[methods.chees]"))
extra = {"A": "", "B": 'trajectory_adaptation = "ceiling"\nwarmup_trajectory_scale = 0.5\n'}
extra["C"] = extra["B"] + "target_accept_prob = 0.75\n"
for name, lines in extra.items():
    open(f"{out}/qs_{name}.toml", "w").write(src.replace(head + "\n", "[methods.chees]\n" + lines, 1))
PY
for v in A B C; do
  rm -rf "$OUT/out_$v"
  echo "option set $v: $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  pyrobdl compare "$OUT/qs_$v.toml" --out "$OUT/out_$v" --no-progress --only method=chees > "$OUT/log_$v" 2>&1
done
python - "$OUT" <<'PY'
import glob, json, os, sys
for v in "ABC":
    for f in sorted(glob.glob(f"{sys.argv[1]}/out_{v}/cells/*/result.json")):
        r = json.load(open(f))
        cert = r.get("certification") or {}
        print(v, os.path.basename(os.path.dirname(f)), f"{r['cost']['gradient_evaluations'] / 1e6:.2f} M chain-gradients",
              f"{r['cost']['cpu_time_s']:.1f} CPU s", "certified" if cert.get("passed") else f"NOT certified: {cert.get('failures')}")
PY
