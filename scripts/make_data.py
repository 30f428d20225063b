"""Example step 1: make a small, deterministic data set (y = 3x + 2 + noise)."""

from __future__ import annotations

import random
import sys
from pathlib import Path


def main(out: str) -> None:
    rng = random.Random(42)
    rows = ["x,y"]
    for _ in range(2000):
        x = rng.uniform(-10, 10)
        rows.append(f"{x:.6f},{3 * x + 2 + rng.gauss(0, 0.5):.6f}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
