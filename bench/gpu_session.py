"""One GPU session in one call: the entry point of bench/gpusession (see its session.py for what runs, and
bench/RESULTS.md for the plan, the record schema and the next window's queue).

    git rev-parse --short HEAD > bench/COMMIT          # before shipping the tree (the GPU machine gets no .git)
    bash bench/gpu_session.sh                          # on the GPU machine: --out $OUT, python3, timeout 590
    python3 bench/gpu_session.py --out /tmp/smoke --smoke   # CPU: every step in seconds (the test suite)
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
for _path in (str(BENCH.parent), str(BENCH)):  # nanopt from the copied tree (no install), then bench's modules
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpusession.session import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
