"""Run every bench/*.py and print one table of their result lines (what `make bench` runs).

Each bench script ends with `NAME ratio=X.XX target=Y baseline=WHAT`; a ratio is always "higher is
better", measured against a baseline taken in the same run. Full outputs go to out/bench/<script>.log.

    python scripts/run_benchmarks.py [--only curate,classify]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = re.compile(
    r"^(?P<name>\S+) ratio=(?P<ratio>[-0-9.]+) target=(?P<target>[-0-9.]+) baseline=(?P<baseline>\S+)$"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated script names (without .py)")
    args = parser.parse_args(argv)
    # A bench runs as a script; a module the benches import (bench/run_profile.py) is not one.
    scripts = [
        script
        for script in sorted((REPO / "bench").glob("*.py"))
        if 'if __name__ == "__main__":' in script.read_text()
    ]
    if args.only:
        wanted = set(args.only.split(","))
        scripts = [script for script in scripts if script.stem in wanted]
    logs = REPO / "out" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for script in scripts:
        print(f"== {script.relative_to(REPO)}", flush=True)
        started = time.monotonic()
        result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True)
        elapsed = time.monotonic() - started
        (logs / f"{script.stem}.log").write_text(result.stdout + result.stderr)
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
        match = RESULT.match(lines[-1]) if lines else None
        if result.returncode != 0 or not match:
            print(f"   failed (exit {result.returncode}); see {logs / (script.stem + '.log')}")
            rows.append((script.stem, "-", "-", "-", "FAILED", elapsed))
            continue
        ratio, target = float(match["ratio"]), float(match["target"])
        verdict = "met" if ratio >= target else "MISSED"
        print(f"   {lines[-1]}  ({elapsed:.0f}s)")
        rows.append((match["name"], f"{ratio:.2f}", f"{target:g}", match["baseline"], verdict, elapsed))
    print()
    print(f"{'bench':<14} {'ratio':>7} {'target':>7}  {'baseline':<32} {'':<7} {'time':>6}")
    for name, ratio, target, baseline, verdict, elapsed in rows:
        print(f"{name:<14} {ratio:>7} {target:>7}  {baseline:<32} {verdict:<7} {elapsed:>5.0f}s")
    return 1 if any(row[4] == "FAILED" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
