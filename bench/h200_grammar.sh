#!/usr/bin/env bash
# The H200 row of grammar masking: grammar masking cost at batch 64 on the Llama-1B shape (vocab 128,256),
# sampled (temperature 1, seeded per request) and greedy, then py-spy of the engine under one
# mode at a time (raw stacks, idle samples included, so the engine thread's wait for the GPU
# shows). Called by `bash bench/h200.sh grammar` with the output folder. Environment:
# GRAMMAR_ARGS adds to every bench run (e.g. "--tokens 64"); GRAMMAR_SHAPE (llama-1b) and
# GRAMMAR_DEVICE (cuda) let it run elsewhere (e.g. tiny / cpu to check the script); GRAMMAR_SPY
# below, GRAMMAR_SPY_ARGS adds to py-spy's (e.g. --native); GRAMMAR_THREAD: the bench's
# --grammar-thread values to run (e.g. "on off"; default auto); GRAMMAR_TEMPS the temperatures
# (default "1 0": sampled and greedy); GRAMMAR_PHASES="" skips the greedy run with per-phase
# host timers (--phases). GRAMMAR_BASE=DIR (a copy of another tree's pdserve/ and bench/, e.g.
# `git archive HEAD~1 pdserve bench | tar -x -C DIR`): each temperature runs that tree and this
# one in turn, GRAMMAR_ROUNDS times (default 2), so an A/B shares the host's speed of the moment.
set -uo pipefail
OUT=${1:-bench/results/h200}
SHAPE=${GRAMMAR_SHAPE:-llama-1b}
M=$(python3 -c "from bench.served import build_model; print(build_model('$SHAPE', 'bfloat16'))" | tail -1)
[ -f "$M/config.json" ] || { echo "no model at $M"; exit 1; }
B=(python3 bench/structured_cpu.py --device "${GRAMMAR_DEVICE:-cuda}" --batch 64 --tokens 128 --model "$M"
  ${GRAMMAR_ARGS:-})
for gt in ${GRAMMAR_THREAD:-auto}; do
  for t in ${GRAMMAR_TEMPS:-1 0}; do
    what="temperature $t ($([ "$t" = 0 ] && echo greedy || echo "sampled, seeded")), all modes, grammar thread $gt"
    if [ -n "${GRAMMAR_BASE:-}" ]; then
      for round in $(seq "${GRAMMAR_ROUNDS:-2}"); do
        echo "--- round $round, $what: base tree ($GRAMMAR_BASE)"
        (cd "$GRAMMAR_BASE" && PYTHONPATH="$GRAMMAR_BASE:${PYTHONPATH#.:}" "${B[@]}" --reps 5 --temperature "$t" \
          --grammar-thread "$gt" 2>&1 | tail -4)
        echo "--- round $round, $what: this tree"
        "${B[@]}" --reps 5 --temperature "$t" --grammar-thread "$gt" 2>&1 | tail -4
      done
      continue
    fi
    echo "--- $what"
    "${B[@]}" --reps 5 --temperature "$t" --grammar-thread "$gt" 2>&1 | tail -8
  done
  if [ -n "${GRAMMAR_PHASES-1}" ]; then  # GRAMMAR_PHASES="": skip
    echo "--- greedy, host time per phase, grammar thread $gt (--phases: timers on, so tok/s is a little lower)"
    "${B[@]}" --reps 3 --temperature 0 --phases --grammar-thread "$gt" 2>&1 | tail -24
  fi
done
SPY=$(command -v py-spy || ls /tmp/pdserve-site/bin/py-spy 2>/dev/null)
[ -n "$SPY" ] || { echo "py-spy not found: no profiles"; exit 0; }
mkdir -p "$OUT/spy"
# GRAMMAR_SPY: which runs to profile, TEMPERATURE:MODE words (default all four; "" for none)
for run in ${GRAMMAR_SPY-1:unconstrained 1:regex 0:unconstrained 0:regex}; do
  t=${run%%:*} mode=${run#*:}
  f="$OUT/spy/t$t-$mode.txt"
  "$SPY" record --rate 400 --format raw --threads --idle ${GRAMMAR_SPY_ARGS:-} --output "$f" -- \
    "${B[@]}" --reps 3 --temperature $t --modes $mode >"$f.log" 2>&1 || { tail -5 "$f.log"; continue; }
  {
    echo "=== py-spy, temperature $t, $mode"
    tail -3 "$f.log"
    python3 bench/pyspy_summary.py "$f" --top 30 --under LLMEngine.step
    python3 bench/pyspy_summary.py "$f" --top 25 --self --under LLMEngine.step
  } >>"$OUT/spy-summary.txt"
done
[ -d "$OUT/spy" ] && [ -n "$(ls -A "$OUT/spy")" ] && tar -C "$OUT" -czf "$OUT/spy.tar.gz" spy
rm -rf "$OUT/spy"
[ -f "$OUT/spy-summary.txt" ] && cat "$OUT/spy-summary.txt" | grep -v "^py-spy> You can" | cut -c1-90 | head -150
