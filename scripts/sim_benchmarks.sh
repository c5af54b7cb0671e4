#!/usr/bin/env bash
# Re-run the simulator benchmarks of docs/benchmarks.md and rebuild results/*/report.md + PNGs.
#   scripts/sim_benchmarks.sh [openb] [gavel] [philly] [latency]    (default: all four)
# Environment: SEEDS (openb seeds, default 10), GPUSCHED_TRACES (default ../shared/traces),
# PHILLY_NODES (default 50), OPENB_GLOB (pod lists to run, default openb_pod_list_*.csv),
# OPENB_POLICIES (default "random best-fit gpusched fgd fgd-full fgd-lookahead fgd-memory"; the baselines need no rerun when only
# the score-based presets changed).
set -euo pipefail
cd "$(dirname "$0")/.."
G=${GPUSCHED:-.venv/bin/gpusched}
TRACES=${GPUSCHED_TRACES:-../shared/traces}
SEEDS=${SEEDS:-10}
PHILLY_NODES=${PHILLY_NODES:-50}
OPENB_GLOB=${OPENB_GLOB:-openb_pod_list_*.csv}
OPENB_POLICIES=${OPENB_POLICIES:-random best-fit gpusched fgd fgd-full fgd-lookahead fgd-memory}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(openb gavel philly latency)

for part in "${parts[@]}"; do
  mkdir -p "results/$part"
  case "$part" in
    openb)
      for f in "$TRACES"/openb/$OPENB_GLOB; do
        w=$(basename "$f" .csv)
        for p in $OPENB_POLICIES; do
          echo "openb $w $p" >&2
          $G bench openb --pods "$f" --nodes "$TRACES/openb/openb_node_list_gpu_node.csv" \
            --policy "$p" --seeds "$SEEDS" --quiet --out "results/openb/${w}__${p}.json"
        done
      done ;;
    gavel)
      for r in 2.0 4.0; do
        # gavel-fifo: the calibration replay of Gavel's own FIFO baseline (not a policy)
        for p in first-fit gpusched best-fit random gavel-fifo; do
          echo "gavel $r $p" >&2
          $G bench gavel --rate "$r" --policy "$p" --quiet --out "results/gavel/rate${r}__${p}.json"
        done
        $G bench gavel --rate "$r" --policy gpusched --preemption migrate --quiet \
          --out "results/gavel/rate${r}__gpusched-migrate.json"
        $G bench gavel --rate "$r" --policy gpusched --replan-ms 20 --quiet \
          --out "results/gavel/rate${r}__gpusched-replan.json"
      done
      # checks on data nothing was tuned on: other seeds of Gavel's generator, smaller clusters,
      # other server sizes, other restart costs (results/gavel/checks, a table in the report)
      mkdir -p results/gavel/checks
      check() { name=$1; shift
        for p in first-fit gpusched; do
          $G bench gavel --policy "$p" --quiet --out "results/gavel/checks/${name}__${p}.json" "$@"
        done
        $G bench gavel --policy gpusched --preemption migrate --quiet \
          --out "results/gavel/checks/${name}__gpusched-migrate.json" "$@"; }
      for s in 1 2 3; do check "seed${s}_rate4.0" --rate 4.0 --stream-seed "$s"; done
      for s in 1 2 3; do
        for p in first-fit gpusched; do
          $G bench gavel --rate 2.0 --stream-seed "$s" --policy "$p" --quiet \
            --out "results/gavel/checks/seed${s}_rate2.0__${p}.json"
        done
        for r in 2.0 4.0; do
          $G bench gavel --rate "$r" --stream-seed "$s" --policy gavel-fifo --quiet \
            --out "results/gavel/checks/seed${s}_rate${r}__gavel-fifo.json"
          $G bench gavel --rate "$r" --stream-seed "$s" --policy gpusched --replan-ms 20 --quiet \
            --out "results/gavel/checks/seed${s}_rate${r}__gpusched-replan.json"
        done
      done
      for a in no-oversubscription update-every-round both; do  # what each of Gavel's FIFO mechanics costs
        for r in 2.0 4.0; do
          $G bench gavel --rate "$r" --policy gavel-fifo --fifo-ablation "$a" --quiet \
            --out "results/gavel/checks/ablation-${a}_rate${r}__gavel-fifo.json"
        done
      done
      check pt24_rate2.0 --rate 2.0 --per-type 24
      check pt28_rate2.0 --rate 2.0 --per-type 28
      for g in 2 6; do
        $G bench gavel --rate 4.0 --gpus-per-server "$g" --policy gpusched --preemption migrate --quiet \
          --out "results/gavel/checks/gps${g}_rate4.0__gpusched-migrate.json"
      done
      for c in 0 60 300 1800; do
        for h in round age; do
          $G bench gavel --rate 4.0 --policy gpusched --preemption migrate --restart-seconds "$c" \
            --horizon "$h" --quiet --out "results/gavel/checks/restart${c}_${h}_rate4.0__gpusched-migrate.json"
        done
      done ;;
    philly)
      for p in first-fit gpusched best-fit; do
        echo "philly $p" >&2
        $G bench philly --policy "$p" --nodes "$PHILLY_NODES" --quiet --out "results/philly/${p}.json"
      done
      $G bench philly --policy gpusched --oracle --nodes "$PHILLY_NODES" --quiet \
        --out "results/philly/gpusched-oracle.json"
      $G bench philly --policy gpusched --oracle --replan-ms 20 --nodes "$PHILLY_NODES" --quiet \
        --out "results/philly/gpusched-oracle-replan.json"
      $G bench philly --policy gpusched --durations predicted --nodes "$PHILLY_NODES" --quiet \
        --out "results/philly/gpusched-predicted.json"
      $G bench philly --policy gpusched --oracle --max-pending 1024 --nodes "$PHILLY_NODES" --quiet \
        --out "results/philly/gpusched-oracle-pending1024.json"
      $G bench philly --policy first-fit --max-pending 1024 --nodes "$PHILLY_NODES" --quiet \
        --out "results/philly/first-fit-pending1024.json"
      for p in gpusched first-fit; do
        $G bench philly --policy "$p" --short-first --nodes "$PHILLY_NODES" --quiet \
          --out "results/philly/${p}-short-first.json"
      done
      $G bench philly --policy first-fit --head-of-line --nodes "$PHILLY_NODES" --quiet \
        --out "results/philly/first-fit-strict-fifo.json" ;;
    latency)
      $G bench latency --nodes 1000 --sweep --policy first-fit --quiet --out "results/latency/first-fit.json"
      $G bench latency --nodes 1000 --sweep --samples 100 --quiet --out "results/latency/gpusched.json"
      $G bench latency --nodes 1000 --sweep --samples 100 --resident --quiet \
        --out "results/latency/gpusched-resident.json" ;;
    *) echo "unknown part $part (openb, gavel, philly, latency)" >&2; exit 2 ;;
  esac
done
$G bench report --traces "$TRACES" >/dev/null
echo "reports: results/*/report.md" >&2
