#!/usr/bin/env bash
# The synthetic-benchmark GPU runs recorded in RESULTS.md (one H100; several small trainings share it).
# usage: bash benchmarks/synth_gpu.sh mqar|mqar-small|mqar-zero|mqar-zoology|mad|state OUT_DIR
set -euo pipefail
what=$1; out=$2
mech=${MECH:-gdn,hdla,hh-gdn,deltanet}  # MECH=hdla: one mechanism; SYNTH_ARGS: more `synth` flags (mad)
case $what in
  mqar)  # MQAR at 512 / 1024 (Head-in-Head Table 8 shapes, a reduced budget), and parity (beta in [0,1] vs [0,2])
    python -m rankdecay.cli synth mqar --preset paper --mechanisms $mech --only seq_len=512,1024 --lr-sweep 2e-3 --steps 2000 \
      --batch-size 64 --jobs 4 --no-progress --out $out/mqar > $out/mqar.log 2>&1 &
    for neg in false true; do
      python -m rankdecay.cli synth parity --preset paper --mechanisms deltanet --set allow_neg_eigval=$neg \
        --lr-sweep 1e-3 --steps 1500 --no-progress --out $out/parity-neg-$neg > $out/parity-$neg.log 2>&1 &
    done
    wait ;;
  mqar-small)  # MQAR at 512 / 1024 with vocabulary 512 (8192 learned nothing in 2000 steps: see RESULTS.md)
    python -m rankdecay.cli synth mqar --preset paper --mechanisms $mech --only seq_len=512,1024 \
      --task-set vocab_size=512 --lr-sweep 2e-3 --steps 1000 --batch-size 64 --jobs 4 --no-progress \
      --out $out/mqar-v512 > $out/mqar-v512.log 2>&1 ;;
  mqar-zero)  # MQAR at 512 with token-0 filler (the Zoology experiment configs; the default since 2026-11-22)
    python -m rankdecay.cli synth mqar --preset paper --mechanisms $mech --only seq_len=512 --lr-sweep 2e-3 \
      --steps 1500 --batch-size 64 --jobs 4 --no-progress --out $out/mqar-zero > $out/mqar-zero.log 2>&1 ;;
  mqar-zoology)  # MQAR: the paper model trained once on Zoology's short-sequence curriculum (64-256 tokens),
                 # tested at 256-2048 tokens; 8 runs share the GPU (the recorded run: 1,600 steps in 391 s),
                 # each stopped at TIME_LIMIT seconds if it has not finished
    python -m rankdecay.cli synth mqar --preset zoology --mechanisms $mech --lr-sweep ${LRS:-2e-3 1e-2} \
      --steps ${STEPS:-1600} --time-limit ${TIME_LIMIT:-430} --train-set matmul_precision=medium --jobs 8 \
      --no-progress --out $out/mqar-zoology > $out/mqar-zoology.log 2>&1 ;;
  state)  # DeltaNet with beta in [0, 1] vs [0, 2]: parity and modular arithmetic (without / with brackets)
    for neg in false true; do
      python -m rankdecay.cli synth parity --preset paper --mechanisms deltanet --set allow_neg_eigval=$neg \
        --lr-sweep 1e-3 --steps 1500 --no-progress --out $out/parity-neg-$neg > $out/parity-$neg.log 2>&1 &
      python -m rankdecay.cli synth modular_arithmetic --preset paper --mechanisms deltanet \
        --set allow_neg_eigval=$neg --lr-sweep 1e-3 --steps 1500 --jobs 2 --no-progress \
        --out $out/modarith-neg-$neg > $out/modarith-$neg.log 2>&1 &
    done
    wait ;;
  mad)   # the six MAD tasks (Head-in-Head Table 7 shapes, a reduced budget)
    for task in in_context_recall fuzzy_in_context_recall noisy_in_context_recall selective_copying compression \
                memorization; do
      python -m rankdecay.cli synth $task --preset paper --mechanisms $mech --lr-sweep 1e-3 3e-3 --steps 600 \
        --jobs 2 --no-progress ${SYNTH_ARGS:-} --out $out/$task > $out/$task.log 2>&1 &
    done
    wait ;;
esac
