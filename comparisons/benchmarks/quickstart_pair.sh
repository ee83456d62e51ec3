#!/bin/bash
# The README's main job (quickstart compare + report, or `compare --report` in one process where the
# revision has it) of an earlier commit and of this checkout,
# one after the other, REPS times: CPU seconds of each command and inside each fit (issue 41, req. 4).
#
#   bash comparisons/benchmarks/quickstart_pair.sh OLD_REV [REPS] [ONLY]   # e.g. d115d86 3
#   SIDE_BY_SIDE=1 bash comparisons/benchmarks/quickstart_pair.sh OLD_REV [REPS] [ONLY]
#
# SIDE_BY_SIDE=1 runs the two at the same time, one per core (cores 0 and 1, swapped every rep),
# so that both see the same host speed; otherwise one after the other (pin with taskset yourself).
# ONLY (optional) is passed to `pyrobdl compare --only`, e.g. `method=nuts` (the cells of one method,
# and the reference cells they need); then the report is skipped.
#
# The old commit runs from a temporary git worktree (removed at the end), the new one from this
# checkout; results go to temporary folders.  Needs the package's environment active and the data
# directory set (PYROBDL_DATA_DIR) as for the README's commands.  Read the pairs' ratios: on a
# shared machine the absolute CPU seconds move between windows.
set -euo pipefail
old_rev=${1:?usage: quickstart_pair.sh OLD_REV [REPS]}
reps=${2:-2}
only=${3:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$tmp/old" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git -C "$here" worktree add --detach "$tmp/old" "$old_rev" >/dev/null 2>&1
# one run of the main job (or of the ONLY cells) of revision $1 (old|new), rep $2, on core $3 (or any)
run_one() {
  local v=$1 rep=$2 core=${3:-} root out report pin=""
  if [ "$v" = old ]; then root="$tmp/old"; else root="$here"; fi
  if [ -n "$core" ]; then pin="taskset -c $core"; fi
  out="$tmp/results_${v}_$rep"
  echo "$(date -u +%T) $v ($(git -C "$root" rev-parse --short HEAD)) pair $rep${core:+, core $core}, load $(cut -d' ' -f1-3 /proc/loadavg)"
  # the main job as the revision's README runs it: `compare --report` in one process where it exists
  report=""
  if [ -z "$only" ] && grep -q -- '"--report"' "$root/pyrobdl/cli.py"; then report="--report"; fi
  (cd "$root" && PYTHONPATH="$root" $pin /usr/bin/time -f "  compare${report:+ --report}: %U user %S sys %e wall" \
      pyrobdl compare comparisons/quickstart.toml --no-progress --out "$out" ${only:+--only "$only"} $report \
      > /dev/null) 2>&1 | tail -1
  if [ -z "$only" ] && [ -z "$report" ]; then
    (cd "$root" && PYTHONPATH="$root" $pin /usr/bin/time -f "  report: %U user %S sys %e wall" \
        pyrobdl report "$out" > /dev/null) 2>&1 | tail -1
  fi
  python - "$out" <<'PY'
import glob, json, sys
rows, total = [], 0.0
for f in sorted(glob.glob(sys.argv[1] + "/cells/*/result.json")):
    r = json.load(open(f))
    c = r["cost"]["cpu_time_s"]
    total += c
    cert = f" (certified {r['certification'].get('passed')})" if r.get("is_reference") else ""
    rows.append(f"{r['dataset']}/{r['method']} {c:.2f}{cert}")
print(f"  inside the fits: {total:.1f} CPU s")
print("  " + "; ".join(rows))
PY
}

for rep in $(seq "$reps"); do
  if [ -n "${SIDE_BY_SIDE:-}" ]; then
    # both at once, one per core, swapping cores each rep: the host's speed, which drifts by
    # +-20% within minutes on the project's machines, is then the same for the two
    if [ $((rep % 2)) = 1 ]; then c_old=0; c_new=1; else c_old=1; c_new=0; fi
    run_one old "$rep" "$c_old" > "$tmp/log_old_$rep" &
    run_one new "$rep" "$c_new" > "$tmp/log_new_$rep" &
    wait
    cat "$tmp/log_old_$rep" "$tmp/log_new_$rep"
  else
    run_one old "$rep"
    run_one new "$rep"
  fi
done
