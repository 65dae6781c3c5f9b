#!/usr/bin/env bash
# A/B timing of the bf16 engine: this tree against another copy of the project (say the last commit,
# `git archive HEAD | tar -x -C OTHER`), `bench/train_gpu.py --modes ours-bf16` in each, alternating on
# one GPU so that both see the same clocks. Prints ms per step of every round, then the medians.
# Usage: bash scripts/gpu_ab.sh OTHER [ROUNDS]     (rows: $ROWS, default 16x512,16x1024,64x512;
#        model: $PRESET, default gpu)
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OTHER=$(cd "${1:?usage: scripts/gpu_ab.sh OTHER [ROUNDS]}" && pwd)
ROUNDS=${2:-2}
ROWS=${ROWS:-16x512,16x1024,64x512}
PRESET=${PRESET:-gpu}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nanoeuler-gpu-ab}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
for r in $(seq "$ROUNDS"); do
    for side in A B; do
        tree=$([ $side = A ] && echo "$OTHER" || pwd)
        echo "=== round $r, $side ($tree)"
        (cd "$tree" && $PY bench/train_gpu.py --preset "$PRESET" --rows "$ROWS" --modes ours-bf16 --steps 30 \
            --json "$LOG_DIR/$side$r.json") 2>&1 | grep -E "^  .*ms/step|failed|Error" || exit 1
    done
done
$PY - "$LOG_DIR" "$ROUNDS" <<'EOF'
import json, statistics, sys
from pathlib import Path
d, rounds = Path(sys.argv[1]), int(sys.argv[2])
runs = {s: [json.loads((d / f"{s}{r}.json").read_text()) for r in range(1, rounds + 1)] for s in "AB"}
print(f"\n{'row':<10} {'A (other) ms per round':<26} {'B (this) ms per round':<26} {'A':>7} {'B':>7} {'B/A':>6}")
for i, row in enumerate(runs["A"][0]):
    a = [run[i]["ms"] for run in runs["A"]]
    b = [run[i]["ms"] for run in runs["B"]]
    ma, mb = statistics.median(a), statistics.median(b)
    name = f"B{row['B']}xT{row['T']}"
    print(f"{name:<10} {' / '.join(f'{x:.2f}' for x in a):<26} {' / '.join(f'{x:.2f}' for x in b):<26} "
          f"{ma:>7.2f} {mb:>7.2f} {mb / ma:>6.3f}")
print(f"peak GiB, A / B: " + ", ".join(f"{x['peak_gib']:.2f} / {y['peak_gib']:.2f}"
                                      for x, y in zip(runs["A"][0], runs["B"][0])))
EOF
