"""Entry point; the harness and its usage: gpusched/bench/api_latency.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusched.bench.api_latency import main

if __name__ == "__main__":
    raise SystemExit(main())
