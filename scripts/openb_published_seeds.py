"""Write the FGD paper's per-seed openb results as a TSV (results/openb/published_per_seed.tsv).

Input on stdin: ``experiments/analysis/expected_results/analysis_allo_discrete.csv`` of
hkust-adsl/kubernetes-scheduler-simulator (Apache-2.0), e.g.
``git --git-dir=<mirror> show HEAD:experiments/analysis/expected_results/analysis_allo_discrete.csv |
python scripts/openb_published_seeds.py > results/openb/published_per_seed.tsv``.
Each of its rows is one (pod list, policy, tuning seed) run; column ``100`` is the GPU allocation %
averaged over the arrivals whose arrived share rounds to 100 %. Output: one row per (pod list,
policy), ten unallocated GPU % values (100 − that column), seeds 42–51 in order.
"""

from __future__ import annotations

import csv
import sys

_POLICIES = {"01-Random": "random", "05-BestFit": "best-fit", "06-FGD": "fgd"}


def main() -> None:
    reader = csv.reader(sys.stdin)
    header = next(reader)
    at_100 = header.index("100")
    runs: dict[tuple[str, str], dict[int, float]] = {}
    for row in reader:
        policy = _POLICIES.get(row[1])
        if policy is None or row[2] != "1.3":
            continue
        runs.setdefault((row[0], policy), {})[int(row[3])] = round(100.0 - float(row[at_100]), 2)
    print("# per-seed unallocated GPU % at 100 % arrival, from hkust-adsl/kubernetes-scheduler-simulator")
    print("# experiments/analysis/expected_results/analysis_allo_discrete.csv (Apache-2.0), tune 1.3,")
    print("# tuning seeds 42-51; written by scripts/openb_published_seeds.py")
    print("workload\tpolicy\t" + "\t".join(f"seed{s}" for s in range(42, 52)))
    for (workload, policy), seeds in sorted(runs.items()):
        print(f"{workload}\t{policy}\t" + "\t".join(f"{seeds[s]:.2f}" for s in sorted(seeds)))


if __name__ == "__main__":
    main()
