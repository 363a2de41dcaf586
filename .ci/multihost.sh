#!/usr/bin/env bash
# The two-process launch of docs/multihost.md, exactly as written there (its block under
# "# Two processes on one machine"), with the Python of VENV, a free port, a tiny model
# and a temporary workdir:
#   1. LAUNCHES fresh launches in a row (default 3): both processes exit 0, process 0
#      prints the evaluations and the file lines, process 1 prints neither, the workdir
#      holds the run (the issue saw 4 of 6 such launches race on the workdir);
#   2. the same launch again: refused by both processes (exit 2), the workdir unchanged;
#   3. the same launch with --resume --steps 16: continued from step 12 by both.
#   .ci/multihost.sh VENV [LAUNCHES]
set -euo pipefail
venv=$(cd "$1" && pwd)
launches=${2:-3}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The doc's block: the lines after its first line, up to the closing fence.
block=$(awk '/^# Two processes on one machine/{on=1; next} on && /^```/{exit} on' docs/multihost.md)
grep -q -- "--process-id 1" <<< "$block" || { echo "docs/multihost.md lost its block"; exit 1; }
tiny="--steps=12 --batch-size=8 --seq-len=32 --d-model=32 --num-heads=2 --num-layers=1"
tiny+=" --eval-every=4 --checkpoint-every=4 --no-progress"

launch() {  # launch WORKDIR [FLAGS]: the block, adapted; 0 when both processes exit 0
  local port script
  port=$("$venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('localhost', 0)); print(s.getsockname()[1])")
  # Process 0 (in the background) writes to p0.out, process 1 to p1.out.
  script=$(sed -e "s|localhost:12355|localhost:$port|g" -e "s|--workdir runs/two|--workdir $1|g" \
    -e "s|^python examples/train_lm.py|\"$venv/bin/python\" examples/train_lm.py $tiny ${*:2}|" \
    -e 's| &$| > "$work/p0.out" 2>\&1 \&|' \
    -e '/--process-id 1/s|$| > "$work/p1.out" 2>\&1 \|\| p1=$?|' <<< "$block")
  work=$work bash -c "$script"$'\n''p0=$?; echo "exit codes: process 0 $p0, process 1 ${p1:-0}"
    test "$p0" = 0 && test "${p1:-0}" = 0'
}

start=$SECONDS
for i in $(seq "$launches"); do
  launch "$work/run$i"
  grep -q "rmsnorm | step 12: train" "$work/p0.out" || { cat "$work/p0.out"; exit 1; }
  grep -q "config:      $work/run$i/config.json" "$work/p0.out" || { cat "$work/p0.out"; exit 1; }
  if grep -q "nats/byte\|config:" "$work/p1.out"; then echo "process 1 printed:"; cat "$work/p1.out"; exit 1; fi
  test -f "$work/run$i/metrics.json" && test -d "$work/run$i/checkpoints/12"
  echo "launch $i of $launches: both processes trained, process 0 alone printed ($((SECONDS - start)) s)"
done

before=$(find "$work/run1" -type f -printf '%p %s %T@\n' | sort)
if launch "$work/run1"; then echo "a second launch into a workdir that holds a run was not refused"; exit 1; fi
grep -q "already holds a run" "$work/p0.out" && grep -q "already holds a run" "$work/p1.out"
test "$before" = "$(find "$work/run1" -type f -printf '%p %s %T@\n' | sort)"
echo "a second launch: refused by both processes, nothing changed ($((SECONDS - start)) s)"

launch "$work/run1" --resume --steps=16
grep -q "resumed from step 12" "$work/p0.out" && grep -q "rmsnorm | step 16: train" "$work/p0.out"
echo "--resume: continued from step 12 to 16 ($((SECONDS - start)) s)"
