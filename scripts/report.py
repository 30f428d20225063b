"""Example step 3: a report from the fitted model."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(coef: str, metrics: str, out: str) -> None:
    c = json.loads(Path(coef).read_text())
    m = json.loads(Path(metrics).read_text())
    Path(out).write_text(
        "# Fit report\n\n"
        f"- model: y = {c['slope']:.4f} x + {c['intercept']:.4f}\n"
        f"- points: {m['n']}\n- mean squared error: {m['mse']:.5f}\n"
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
