"""Example step 2 (the remote one): fit y = a*x + b by least squares.

Stands in for a training run: reads its input read-only, writes only its
declared outputs, and would run the same on a GPU box.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(data: str, out_dir: str) -> None:
    xs, ys = [], []
    for line in Path(data).read_text().splitlines()[1:]:
        x, y = line.split(",")
        xs.append(float(x))
        ys.append(float(y))
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    pairs = list(zip(xs, ys))  # noqa: B905 - runs on the host's python3, maybe 3.8
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    mse = sum((y - (slope * x + intercept)) ** 2 for x, y in pairs) / n
    out = Path(out_dir)
    (out / "coef.json").write_text(json.dumps({"slope": slope, "intercept": intercept}, indent=1) + "\n")
    (out / "metrics.json").write_text(json.dumps({"n": n, "mse": mse}, indent=1) + "\n")
    print(f"fitted y = {slope:.3f} x + {intercept:.3f} on {n} points (mse {mse:.4f})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
