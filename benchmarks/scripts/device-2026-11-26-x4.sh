#!/usr/bin/env bash
# Device calls of the 2026-11-26 session, on one host of 4 GPUs (nvidia-h200-x4 / h100-x4):
#   bash benchmarks/scripts/device-2026-11-26-x4.sh 1   # GPUs 0,1: 1.3B memory benchmark, then the
#                                                       #   small pipeline benchmark; GPUs 2,3: the 2-GPU tests
#   bash benchmarks/scripts/device-2026-11-26-x4.sh 2   # the zero-bubble benchmark, seq 2048 on GPUs 0,1
#                                                       #   and seq 512 on GPUs 2,3, then merged
#   bash benchmarks/scripts/device-2026-11-26-x4.sh 3   # all 4 GPUs: all-reduce at 4 ranks, TP=2 x PP=2
#                                                       #   (one round), the 1.3B memory benchmark at pp=4
#   LIMIT=250 bash benchmarks/scripts/device-2026-11-26-x4.sh 4   # re-checks and rounds (see phase 4)
#   bash benchmarks/scripts/device-2026-11-26-x4.sh 5   # second session: GPUs 0,1 the 2-GPU pipeline and
#                                                       #   zero-bubble tests; GPUs 2,3 allocator traces of
#                                                       #   the runs whose graphed memory exceeds eager's
#   bash benchmarks/scripts/device-2026-11-26-x4.sh 6   # traces again: the graphs' pool in expandable
#                                                       #   segments; the trainer without return_outputs;
#                                                       #   the 2-GPU tests after the capture-loop change
#   LIMIT=330 bash benchmarks/scripts/device-2026-11-26-x4.sh 7   # GPUs 0,1: graphed 1F1B / zbv /
#                                                       #   interleaved_zb in 3 alternating rounds at seq 2048,
#                                                       #   4 micro-batches; GPUs 2,3: memory traces (tied
#                                                       #   modules eager; without return_outputs)
#   LIMIT=420 bash benchmarks/scripts/device-2026-11-26-x4.sh 8   # after outputs give their memory back
#                                                       #   where the recorded step freed them: GPUs 0,1 the
#                                                       #   GPU tests; GPUs 2,3 traces of the graphed runs,
#                                                       #   then the zero-bubble GPU tests
#   LIMIT=300 bash benchmarks/scripts/device-2026-11-26-x4.sh 9   # the zero-bubble benchmark at seq 2048
#                                                       #   without return_outputs: 4 micro-batches on GPUs
#                                                       #   0,1, 8 on GPUs 2,3, then merged (the merge ran
#                                                       #   here afterwards: the call's time was spent)
#   LIMIT=120 bash benchmarks/scripts/device-2026-11-26-x4.sh 10  # traces of graphed zbv and interleaved_zb,
#                                                       #   8 micro-batches, without return_outputs
#   LIMIT=540 bash benchmarks/scripts/device-2026-11-26-x4.sh 11  # third session: GPUs 0,1 the zero-bubble
#                                                       #   and pipeline GPU tests on the final engine;
#                                                       #   GPUs 2,3 traces of zbv (eager, eager keeping its
#                                                       #   gradients, graphed) and where graphed steps idle
#   LIMIT=420 bash benchmarks/scripts/device-2026-11-26-x4.sh 12  # after gradients handed between graphs wait
#                                                       #   for their recorded readers only: GPUs 0,1 traces of
#                                                       #   graphed runs with the pool reserve as it is and
#                                                       #   sized to the eager peak (experiment); GPUs 2,3 the
#                                                       #   zero-bubble and pipeline GPU tests
#   LIMIT=300 bash benchmarks/scripts/device-2026-11-26-x4.sh 13  # GPUs 0,1: traces with the pools' segments
#                                                       #   (graphed zbv, interleaved_zb, dualpipev); GPUs 2,3:
#                                                       #   graphed 1F1B / zbv in 3 alternating rounds at seq
#                                                       #   2048, 4 micro-batches, without return_outputs
#   LIMIT=540 bash benchmarks/scripts/device-2026-11-26-x4.sh 14  # the zero-bubble benchmark at seq 2048
#                                                       #   without return_outputs (4 micro-batches on GPUs
#                                                       #   0,1, 8 on GPUs 2,3, merged with phase 13's rounds),
#                                                       #   then the zero-bubble / pipeline GPU tests
#   LIMIT=300 bash benchmarks/scripts/device-2026-11-26-x4.sh 15  # phase 14's benchmark again after the
#                                                       #   zero-sum gradient wrapper was reverted (phase 14's
#                                                       #   graphed peaks were 0.2-1.0 GB higher than phase
#                                                       #   12-13's traces); then a trace under the benchmark's
#                                                       #   settings (12 steps, the last 3 profiled)
#   LIMIT=560 bash benchmarks/scripts/device-2026-11-26-x4.sh 16  # fourth session, the final engine with the
#                                                       #   weight pass's gradient alias that keeps the real
#                                                       #   gradient for the node: the seq-2048 zero-bubble
#                                                       #   benchmark (4 micro-batches on GPUs 0,1, 8 on 2,3),
#                                                       #   then the pipeline and zero-bubble GPU tests
#   LIMIT=560 bash benchmarks/scripts/device-2026-11-26-x4.sh 17  # GPUs 0,1: where the graph pool grows (traces
#                                                       #   of graphed zbv, 8 micro-batches, with and without
#                                                       #   the reserve before capture), then the benchmark's
#                                                       #   graphed runs without the reserve; GPUs 2,3: the
#                                                       #   zero-bubble benchmark at seq 512
#   LIMIT=330 bash benchmarks/scripts/device-2026-11-26-x4.sh 18  # GPUs 0,1: traces of the two runs that peaked
#                                                       #   higher without the reserve (1F1B 8 and dualpipev 4
#                                                       #   micro-batches), then dualpipev at seq 512, 4 micro-
#                                                       #   batches (phase 17's part ran out of budget before
#                                                       #   it); GPUs 2,3: graphed zbv / 1F1B in 3 alternating
#                                                       #   rounds at seq 2048, 4 micro-batches
#   LIMIT=520 bash benchmarks/scripts/device-2026-11-26-x4.sh 19  # the benchmark's graphed runs without the
#                                                       #   reserved block again, now that captures wait for the
#                                                       #   first optimizer step either way (seq 2048 and 512);
#                                                       #   dualpipev at seq 512, 8 micro-batches; graphed zbv /
#                                                       #   1F1B in 5 alternating rounds at seq 2048
#   LIMIT=250 bash benchmarks/scripts/device-2026-11-26-x4.sh 20  # the final code (the review's mend of the
#                                                       #   weight pass's alias): the pipeline GPU tests on GPUs
#                                                       #   0,1; the zero-bubble GPU tests and the benchmark's
#                                                       #   graphed zbv run (8 micro-batches) on GPUs 2,3
#   LIMIT=330 bash benchmarks/scripts/device-2026-11-26-x4.sh 21  # fifth session, the pool reserved as the
#                                                       #   optimizer temporaries' segments: the seq-2048 zero-
#                                                       #   bubble benchmark (4 micro-batches on GPUs 0,1, 8 on
#                                                       #   2,3), a trace of graphed zbv (8), the reserve's GPU test
#   LIMIT=540 bash benchmarks/scripts/device-2026-11-26-x4.sh 22  # the seq-512 benchmark (4 on GPUs 0,1, 8 on
#                                                       #   2,3), dualpipev at seq 2048 with 8 (phase 21 ran out of
#                                                       #   budget before it), then the pipeline / zero-bubble /
#                                                       #   engine GPU tests (run after phase 23)
#   LIMIT=380 bash benchmarks/scripts/device-2026-11-26-x4.sh 23  # phase 21 again with captures keeping the
#                                                       #   segments larger than every parameter whole; a trace
#                                                       #   of graphed dualpipev (4); the placement GPU tests
#   LIMIT=230 bash benchmarks/scripts/device-2026-11-26-x4.sh 24  # dualpipev at seq 2048 with 8 (phase 22's part
#                                                       #   had too small a budget for it); traces of eager and
#                                                       #   graphed dualpipev with 4 (the setting over the bound)
#   LIMIT=150 bash benchmarks/scripts/device-2026-11-26-x4.sh 25  # raw allocator histories (GRAPHPP_MEMTRACE_RAW)
#                                                       #   of graphed dualpipev and zbv with 4 micro-batches, the
#                                                       #   pool reserved as segments and as one block
#   LIMIT=90 bash benchmarks/scripts/device-2026-11-26-x4.sh 26   # the model's prediction checked: graphed
#                                                       #   dualpipev and zbv (4) with no reserve, as the benchmark
#                                                       #   runs them, with raw histories
#   LIMIT=280 bash benchmarks/scripts/device-2026-11-26-x4.sh 27  # the final code (one block by default again):
#                                                       #   pipeline GPU tests on GPUs 0,1; zero-bubble and engine
#                                                       #   GPU tests and the benchmark's graphed zbv run (4) on 2,3
#   LIMIT=120 bash benchmarks/scripts/device-2026-11-26-x4.sh 28  # after the review's mends of reserve() (what
#                                                       #   was allocated before an OOM counts, once per process):
#                                                       #   the engine GPU tests on GPUs 0,1; the graphed zbv run (4)
#                                                       #   with a raw history on GPUs 2,3
#   LIMIT=560 bash benchmarks/scripts/device-2026-11-26-x4.sh 29  # sixth session, graph pools as expandable
#                                                       #   segments (the default now): their GPU tests first (the
#                                                       #   rest is skipped if they fail), then the zero-bubble
#                                                       #   benchmark, seq 2048 with 4 and seq 512 with 8 micro-
#                                                       #   batches on GPUs 0,1, seq 2048 with 8 and seq 512 with 4
#                                                       #   on GPUs 2,3
#   LIMIT=560 bash benchmarks/scripts/device-2026-11-26-x4.sh 30  # the GPU test suites with graph pools as
#                                                       #   expandable segments: pipeline, Hugging Face, all-reduce
#                                                       #   on GPUs 0,1; zero-bubble, engine, pool segments, optim,
#                                                       #   generators, faults, allocator on GPUs 2,3
#   LIMIT=420 bash benchmarks/scripts/device-2026-11-26-x4.sh 31  # expandable graph pools elsewhere: GPUs 0,1 the
#                                                       #   1.3B memory benchmark at pp=2 (eager, default) and a raw
#                                                       #   allocator history of graphed zbv (4); GPUs 2,3 graphed
#                                                       #   1F1B / zbv in 3 alternating rounds at seq 2048 (4); then
#                                                       #   all 4 GPUs: the memory benchmark at pp=4 (eager, default)
#   LIMIT=230 bash benchmarks/scripts/device-2026-11-26-x4.sh 32  # after the window passes the allocator's other
#                                                       #   settings along: pool segments and engine GPU tests, then
#                                                       #   the graphed zbv run (4) on GPUs 0,1; the zero-bubble GPU
#                                                       #   tests on GPUs 2,3
#   LIMIT=100 bash benchmarks/scripts/device-2026-11-26-x4.sh 33  # the pool segments GPU tests again (phase 32's
#                                                       #   settings test read a statistic that did not show the
#                                                       #   setting; it now watches what the setting does)
#   LIMIT=120 bash benchmarks/scripts/device-2026-11-26-x4.sh 34  # after a review's mends of the window (the
#                                                       #   environment's order, a failed switch, a borrowed step whose
#                                                       #   window cannot open): pool segments and engine GPU tests
# Between phases 3 and 4 one call ran by hand: the failed pipeline test case again (it had lost a port
# race with the concurrent benchmark: EADDRINUSE) on GPUs 0,1 and `bench_hybrid.py --pp 1 --rounds 1`
# on GPUs 2,3.
# Two GPU pairs run two queues side by side (every benchmark run in its own processes); with only
# 2 GPUs the queues run one after the other. LIMIT (seconds, default 560) bounds the whole call:
# a job gets what is left, and one that cannot start in time is recorded as skipped.
# Everything comes back as $OUT/run.tgz (logs, new result files, environment) plus status.txt.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PHASE=${1:?phase 1, 2, 3 or 4}
LIMIT=${LIMIT:-560}
DEST=${OUT:-/tmp/out}; unset OUT  # the tools copy results to $OUT themselves: keep them to one archive
R=/tmp/r$PHASE; mkdir -p "$R/logs" "$DEST"
START=$SECONDS
touch "$R/.start"
GPUS=$(nvidia-smi -L | wc -l)
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -8
  python -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'nccl',torch.cuda.nccl.version(),'python',sys.version.split()[0])"
  echo "phase $PHASE limit ${LIMIT}s gpus $GPUS git $(git rev-parse --short HEAD 2>/dev/null)"; } > "$R/env.txt" 2>&1

left() { echo $(( LIMIT - (SECONDS - START) )); }

# job NAME WANT_SECONDS CMD...: runs CMD under a timeout of min(WANT, what is left - 20).
job() {
  local name=$1 want=$2; shift 2
  local l=$(( $(left) - 20 )) t0=$SECONDS rc
  local t=$(( want < l ? want : l ))
  if [ "$t" -lt 40 ]; then echo "$name: skipped (${l}s left)" >> "$R/status.txt"; return; fi
  echo "[$(( SECONDS - START ))s] $name (up to ${t}s) on GPUs ${CUDA_VISIBLE_DEVICES:-all}" >> "$R/progress.txt"
  timeout -k 10 "$t" "$@" > "$R/logs/$name.log" 2>&1; rc=$?
  echo "$name: rc=$rc in $(( SECONDS - t0 ))s (limit ${t}s)" >> "$R/status.txt"
}

pytest_job() {  # pytest_job NAME WANT TESTS...
  local name=$1 want=$2; shift 2
  job "$name" "$want" python -m pytest -q -p no:cacheprovider -rfE "$@"
}

budget() { echo $(( $(left) - ${1:-40} )); }  # a benchmark's own --budget: ends before its job's timeout

# zb_part NAME WANT SEQ MICRO_BATCHES RESULT_NAME BUDGET [BENCH ARGS...]: one part of the zero-bubble
# benchmark without return_outputs (tools/bench_zero_bubble.py), its result <RESULT_NAME>-<device>.json
zb_part() {
  local name=$1 want=$2 seq=$3 mbs=$4 result=$5 bench_budget=$6; shift 6
  job "$name" "$want" python tools/bench_zero_bubble.py --seq "$seq" --micro-batches "$mbs" "$@" \
    --trainer-args=--no-return-outputs --name "$result" --budget "$bench_budget"
}

# the GPT-3 1.3B shape of the trainer's runs (each phase adds its sequence, steps, timeout)
G13B_BASE="--framework torch --pp 2 --hidden 2048 --layers 24 --heads 16 --vocab 50304 --micro-batch-size 1"
G13B_BASE="$G13B_BASE --dtype bfloat16 --attention sdpa --dropout 0.1 --seed 1234"

queue_a() { :; }
queue_b() { :; }
queue_all() { :; }
case "$PHASE" in
  1)
    queue_a() {
      job memory-gpt1.3b 480 python tools/bench_pipeline_memory.py --preset gpt1.3b --rounds 2 --budget 440
      job pipeline 600 python tools/bench_pipeline.py --rounds 1 --budget "$(budget)"
    }
    queue_b() {
      pytest_job tests-pipeline 260 unittests/gpu/test_pipeline_gpu.py
      pytest_job tests-zero-bubble-2gpu 220 unittests/gpu/test_zero_bubble_gpu.py -k two_gpus
      pytest_job tests-hf-2gpu 150 unittests/gpu/test_hf_gpu.py -k two_gpus
      pytest_job tests-faults-2gpu 120 unittests/gpu/test_faults_gpu.py -k two_ranks
      pytest_job tests-allreduce 150 unittests/gpu/test_allreduce_gpu.py
    } ;;
  2)
    queue_a() {
      job zb-seq2048 600 python tools/bench_zero_bubble.py --seq 2048 --name zero-bubble-seq2048 --budget "$(budget 75)"
    }
    queue_b() {
      job zb-seq512 600 python tools/bench_zero_bubble.py --seq 512 --name zero-bubble-seq512 --budget "$(budget 75)"
    } ;;
  3)
    queue_all() {
      job allreduce-4r 170 python tools/bench_allreduce.py --ranks 4 --rounds 20 --timeout 150
      job hybrid-tp2pp2 240 python tools/bench_hybrid.py --rounds 1 --budget 220
      job memory-gpt1.3b-pp4 600 python tools/bench_pipeline_memory.py --preset gpt1.3b-pp4 --variants eager,default \
        --rounds 1 --budget "$(budget)"
    } ;;
  4)  # after the first three: the 2-GPU Hugging Face cases after the contiguous-input fix, the README's
      # examples on GPUs; the eager run-to-run loss spread of the interleaved 1.3B pipeline at seq 2048
      # beside its graphed run; graphed 1F1B against graphed ZBV at seq 2048, 4 micro-batches, in rounds
    G13B="$G13B_BASE --seq-len 2048"
    queue_a() {
      pytest_job tests-hf-2gpu 150 unittests/gpu/test_hf_gpu.py -k two_gpus
      pytest_job readme-hf-examples 150 unittests/test_readme_examples.py -k "hf_pipe or hf_llama"
    }
    queue_b() {
      job loss-spread-vpp2 130 python tools/bench_rounds.py --name rounds-vpp2-seq2048 --rounds 2 --budget 120 \
        --base "$G13B --micro-batches 8 --steps 10 --timeout 120" --variant eager="--vpp 2" \
        --variant graphed="--vpp 2 --cudagraph"
      job zb-rounds 130 python tools/bench_rounds.py --name rounds-zb-seq2048-mb4 --rounds 2 --budget "$(budget 30)" \
        --base "$G13B --micro-batches 4 --steps 12 --timeout 120" --variant graphed_1f1b="--cudagraph" \
        --variant graphed_zbv="--vpp 2 --schedule zbv --cudagraph"
    } ;;
  5)  # the new-signature / failed-capture 2-GPU test (issue 13) and the refactored zero-bubble one;
      # memory traces (tools/memtrace.py) of eager and graphed runs at seq 2048 where graphed held more
    G13B="$G13B_BASE --seq-len 2048 --steps 6 --timeout 150"
    queue_a() {
      pytest_job tests-pipeline 330 unittests/gpu/test_pipeline_gpu.py
      pytest_job tests-zero-bubble-2gpu 200 unittests/gpu/test_zero_bubble_gpu.py -k two_gpus
    }
    queue_b() {
      local mode
      for cfg in "1f1b-mb4:--micro-batches 4" "izb-mb8:--micro-batches 8 --vpp 2 --schedule interleaved_zb" \
                 "zbv-mb8:--micro-batches 8 --vpp 2 --schedule zbv" "zbv-mb4:--micro-batches 4 --vpp 2 --schedule zbv"; do
        for mode in eager graphed; do
          local g=""; [ $mode = graphed ] && g="--cudagraph"
          # shellcheck disable=SC2086
          job "trace-${cfg%%:*}-$mode" 120 python tools/train_gpt.py $G13B ${cfg#*:} --memory-trace $g
        done
      done
    } ;;
  6)
    G13B="$G13B_BASE --seq-len 2048 --steps 6 --timeout 150"
    trace() {  # trace NAME ENV... -- TRAINER ARGS... (phases 6 and 7)
      local name=$1; shift; local envs=()
      while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
      # shellcheck disable=SC2086
      job "trace-$name" 100 env "${envs[@]}" python tools/train_gpt.py $G13B "$@" --memory-trace
    }
    X=FLAGS_graphpp_expandable_pool=1
    queue_a() {
      trace 1f1b-mb4-graphed-x $X -- --micro-batches 4 --cudagraph
      trace izb-mb8-graphed-x $X -- --micro-batches 8 --vpp 2 --schedule interleaved_zb --cudagraph
      trace zbv-mb8-graphed-x $X -- --micro-batches 8 --vpp 2 --schedule zbv --cudagraph
      trace zbv-mb4-graphed-x $X -- --micro-batches 4 --vpp 2 --schedule zbv --cudagraph
      trace izb-mb8-eager-n -- --micro-batches 8 --vpp 2 --schedule interleaved_zb --no-return-outputs
      trace izb-mb8-graphed-xn $X -- --micro-batches 8 --vpp 2 --schedule interleaved_zb --no-return-outputs --cudagraph
      trace zbv-mb8-eager-n -- --micro-batches 8 --vpp 2 --schedule zbv --no-return-outputs
      trace zbv-mb8-graphed-xn $X -- --micro-batches 8 --vpp 2 --schedule zbv --no-return-outputs --cudagraph
      trace dpv-mb8-graphed-x $X -- --micro-batches 8 --vpp 2 --schedule dualpipev --cudagraph
    }
    queue_b() {
      pytest_job tests-pipeline-new-signature 150 unittests/gpu/test_pipeline_gpu.py -k new_signature
      pytest_job tests-zero-bubble-2gpu 150 unittests/gpu/test_zero_bubble_gpu.py -k two_gpus
      trace 1f1b-mb4-eager-n -- --micro-batches 4 --no-return-outputs
      trace 1f1b-mb4-graphed-xn $X -- --micro-batches 4 --no-return-outputs --cudagraph
      trace 1f1b-mb4-graphed-n -- --micro-batches 4 --no-return-outputs --cudagraph
    } ;;
  7)
    G13B="$G13B_BASE --seq-len 2048"
    queue_a() {
      job zb-rounds3 300 python tools/bench_rounds.py --name rounds3-zb-seq2048-mb4 --rounds 3 --budget 285 \
        --base "$G13B --micro-batches 4 --steps 12 --timeout 120" --variant graphed_1f1b="--cudagraph" \
        --variant graphed_zbv="--vpp 2 --schedule zbv --cudagraph" \
        --variant graphed_interleaved_zb="--vpp 2 --schedule interleaved_zb --cudagraph"
    }
    queue_b() {
      local t="--steps 6 --timeout 150 --memory-trace"
      # shellcheck disable=SC2086
      {
      job trace-zbv-mb8-graphed-tied 100 python tools/train_gpt.py $G13B $t --micro-batches 8 --vpp 2 --schedule zbv --cudagraph --graph-eager-tied
      job trace-izb-mb8-graphed-tied 100 python tools/train_gpt.py $G13B $t --micro-batches 8 --vpp 2 --schedule interleaved_zb --cudagraph --graph-eager-tied
      job trace-zbv-mb4-graphed-tied 100 python tools/train_gpt.py $G13B $t --micro-batches 4 --vpp 2 --schedule zbv --cudagraph --graph-eager-tied
      job trace-izb-mb8-graphed-n 100 python tools/train_gpt.py $G13B $t --micro-batches 8 --vpp 2 --schedule interleaved_zb --cudagraph --no-return-outputs
      job trace-zbv-mb8-graphed-n 100 python tools/train_gpt.py $G13B $t --micro-batches 8 --vpp 2 --schedule zbv --cudagraph --no-return-outputs
      job trace-1f1b-mb8-eager-n 100 python tools/train_gpt.py $G13B $t --micro-batches 8 --no-return-outputs
      job trace-1f1b-mb8-graphed-n 100 python tools/train_gpt.py $G13B $t --micro-batches 8 --no-return-outputs --cudagraph
      }
    } ;;
  8)
    G13B="$G13B_BASE --seq-len 2048 --steps 6 --timeout 150"
    queue_a() {
      pytest_job tests-engine 80 unittests/gpu/test_engine_gpu.py
      pytest_job tests-faults 100 unittests/gpu/test_faults_gpu.py
      pytest_job tests-generators-allocator-optim 120 unittests/gpu/test_generators_gpu.py \
        unittests/gpu/test_allocator_gpu.py unittests/gpu/test_optim_gpu.py
      pytest_job tests-hf 110 unittests/gpu/test_hf_gpu.py
      pytest_job tests-pipeline-default 100 unittests/gpu/test_pipeline_gpu.py -k "default"
    }
    queue_b() {
      local cfg mb
      for cfg in "zbv:--vpp 2 --schedule zbv" "izb:--vpp 2 --schedule interleaved_zb" "dpv:--vpp 2 --schedule dualpipev" "1f1b:"; do
        for mb in 8 4; do
          # shellcheck disable=SC2086
          job "trace-${cfg%%:*}-mb$mb-graphed-r" 60 python tools/train_gpt.py $G13B ${cfg#*:} --micro-batches $mb \
            --cudagraph --memory-trace
        done
      done
      pytest_job tests-zero-bubble 150 unittests/gpu/test_zero_bubble_gpu.py
    } ;;
  9)
    queue_a() {
      zb_part zb-seq2048-mb4-n 280 2048 4 zero-bubble-seq2048-mb4-noret "$(budget 30)"
    }
    queue_b() {
      zb_part zb-seq2048-mb8-n 280 2048 8 zero-bubble-seq2048-mb8-noret "$(budget 30)"
    } ;;
  10)
    G13B="$G13B_BASE --seq-len 2048 --steps 6 --timeout 90"
    # shellcheck disable=SC2086
    queue_a() {
      job trace-zbv-mb8-graphed-n2 80 python tools/train_gpt.py $G13B --micro-batches 8 --vpp 2 --schedule zbv \
        --no-return-outputs --cudagraph --memory-trace
    }
    # shellcheck disable=SC2086
    queue_b() {
      job trace-izb-mb8-graphed-n2 80 python tools/train_gpt.py $G13B --micro-batches 8 --vpp 2 \
        --schedule interleaved_zb --no-return-outputs --cudagraph --memory-trace
    } ;;
  11)
    G13B="$G13B_BASE --seq-len 2048 --timeout 90"
    queue_a() {
      pytest_job tests-zero-bubble 220 unittests/gpu/test_zero_bubble_gpu.py
      pytest_job tests-pipeline 300 unittests/gpu/test_pipeline_gpu.py
    }
    # shellcheck disable=SC2086
    queue_b() {
      local zbv="--vpp 2 --schedule zbv --no-return-outputs" t="--steps 6 --memory-trace"
      job trace-zbv-mb8-eager-n3 90 python tools/train_gpt.py $G13B $t --micro-batches 8 $zbv
      job trace-zbv-mb8-eager-keep 90 python tools/train_gpt.py $G13B $t --micro-batches 8 $zbv --keep-grads
      job trace-zbv-mb8-graphed-n3 90 python tools/train_gpt.py $G13B $t --micro-batches 8 $zbv --cudagraph
      job gaps-zbv-mb4-graphed 70 python tools/train_gpt.py $G13B --steps 8 --profile-steps 3 --micro-batches 4 \
        $zbv --cudagraph
      job gaps-1f1b-mb4-graphed 70 python tools/train_gpt.py $G13B --steps 8 --profile-steps 3 --micro-batches 4 \
        --no-return-outputs --cudagraph
    } ;;
  12)
    G13B="$G13B_BASE --seq-len 2048 --timeout 90"
    # shellcheck disable=SC2086
    queue_a() {
      local cfg
      for cfg in "zbv-mb8:--micro-batches 8 --vpp 2 --schedule zbv" "izb-mb8:--micro-batches 8 --vpp 2 --schedule interleaved_zb" \
                 "zbv-mb4:--micro-batches 4 --vpp 2 --schedule zbv" "dpv-mb8:--micro-batches 8 --vpp 2 --schedule dualpipev" \
                 "1f1b-mb8:--micro-batches 8"; do
        job "trace-${cfg%%:*}-graphed-r12" 60 python tools/train_gpt.py $G13B --steps 6 ${cfg#*:} --no-return-outputs \
          --cudagraph --memory-trace
        job "trace-${cfg%%:*}-graphed-peak" 60 env FLAGS_graphpp_reserve_to_peak=1 python tools/train_gpt.py $G13B \
          --steps 6 ${cfg#*:} --no-return-outputs --cudagraph --memory-trace
      done
    }
    queue_b() {
      pytest_job tests-zero-bubble 200 unittests/gpu/test_zero_bubble_gpu.py
      pytest_job tests-pipeline 260 unittests/gpu/test_pipeline_gpu.py
    } ;;
  13)
    G13B="$G13B_BASE --seq-len 2048"
    # shellcheck disable=SC2086
    queue_a() {
      local cfg
      for cfg in "zbv-mb8:--micro-batches 8 --vpp 2 --schedule zbv" "izb-mb8:--micro-batches 8 --vpp 2 --schedule interleaved_zb" \
                 "dpv-mb4:--micro-batches 4 --vpp 2 --schedule dualpipev" "zbv-mb8-eager:--micro-batches 8 --vpp 2 --schedule zbv"; do
        local g="--cudagraph"; case $cfg in *-eager:*) g="";; esac
        job "trace-${cfg%%:*}-r13" 60 python tools/train_gpt.py $G13B --timeout 90 --steps 6 ${cfg#*:} --no-return-outputs \
          $g --memory-trace
      done
    }
    queue_b() {
      job zb-rounds3-n 280 python tools/bench_rounds.py --name rounds3-zb-seq2048-mb4-noret --rounds 3 --budget 265 \
        --base "$G13B --micro-batches 4 --steps 12 --timeout 120 --no-return-outputs" --variant graphed_1f1b="--cudagraph" \
        --variant graphed_zbv="--vpp 2 --schedule zbv --cudagraph"
    } ;;
  14)
    queue_a() {
      zb_part zb-seq2048-mb4-n 300 2048 4 zero-bubble-seq2048-mb4-noret3 280
      pytest_job tests-zero-bubble 150 unittests/gpu/test_zero_bubble_gpu.py
    }
    queue_b() {
      zb_part zb-seq2048-mb8-n 300 2048 8 zero-bubble-seq2048-mb8-noret3 280
      pytest_job tests-pipeline 230 unittests/gpu/test_pipeline_gpu.py
    } ;;
  15)
    G13B="$G13B_BASE --seq-len 2048"
    # shellcheck disable=SC2086
    queue_a() {
      zb_part zb-seq2048-mb4-n 240 2048 4 zero-bubble-seq2048-mb4-noret4 220
      job trace-zbv-mb8-profiled-r15 50 python tools/train_gpt.py $G13B --timeout 90 --steps 12 --profile-steps 3 \
        --micro-batches 8 --vpp 2 --schedule zbv --no-return-outputs --cudagraph --memory-trace
    }
    queue_b() {
      zb_part zb-seq2048-mb8-n 240 2048 8 zero-bubble-seq2048-mb8-noret4 220
    } ;;
  16)
    queue_a() {
      zb_part zb-seq2048-mb4-n 280 2048 4 zero-bubble-seq2048-mb4-noret5 260
      pytest_job tests-pipeline 230 unittests/gpu/test_pipeline_gpu.py
    }
    queue_b() {
      zb_part zb-seq2048-mb8-n 360 2048 8 zero-bubble-seq2048-mb8-noret5 340
      pytest_job tests-zero-bubble 150 unittests/gpu/test_zero_bubble_gpu.py
    } ;;
  17)
    G13B=$G13B_BASE
    # shellcheck disable=SC2086
    queue_a() {
      job trace-zbv-mb8-r17 70 python tools/train_gpt.py $G13B --seq-len 2048 --timeout 90 --steps 6 --micro-batches 8 \
        --vpp 2 --schedule zbv --no-return-outputs --cudagraph --memory-trace
      FLAGS_graphpp_reserve_pool=0 job trace-zbv-mb8-noreserve-r17 70 python tools/train_gpt.py $G13B --seq-len 2048 \
        --timeout 90 --steps 6 --micro-batches 8 --vpp 2 --schedule zbv --no-return-outputs --cudagraph --memory-trace
      local cfg
      for cfg in "zbv-mb4:--seq-len 2048 --micro-batches 4 --vpp 2 --schedule zbv" \
                 "1f1b-mb8:--seq-len 2048 --micro-batches 8" "1f1b-mb4:--seq-len 2048 --micro-batches 4" \
                 "izb-mb8:--seq-len 2048 --micro-batches 8 --vpp 2 --schedule interleaved_zb" \
                 "izb-mb4:--seq-len 2048 --micro-batches 4 --vpp 2 --schedule interleaved_zb" \
                 "dpv-mb8:--seq-len 2048 --micro-batches 8 --vpp 2 --schedule dualpipev" \
                 "dpv-mb4:--seq-len 2048 --micro-batches 4 --vpp 2 --schedule dualpipev" \
                 "zbv-s512-mb8:--seq-len 512 --micro-batches 8 --vpp 2 --schedule zbv" \
                 "1f1b-s512-mb8:--seq-len 512 --micro-batches 8"; do
        FLAGS_graphpp_reserve_pool=0 job "noreserve-${cfg%%:*}" 50 python tools/train_gpt.py $G13B ${cfg#*:} --steps 12 \
          --timeout 120 --profile-steps 3 --no-return-outputs --cudagraph
      done
    }
    queue_b() {
      zb_part zb-seq512-mb4-n 260 512 4 zero-bubble-seq512-mb4-noret5 240
      zb_part zb-seq512-mb8-n 260 512 8 zero-bubble-seq512-mb8-noret5 240
    } ;;
  18)
    G13B=$G13B_BASE
    # shellcheck disable=SC2086
    queue_a() {
      FLAGS_graphpp_reserve_pool=0 job trace-1f1b-mb8-noreserve-r18 45 python tools/train_gpt.py $G13B --seq-len 2048 \
        --timeout 90 --steps 6 --micro-batches 8 --no-return-outputs --cudagraph --memory-trace
      FLAGS_graphpp_reserve_pool=0 job trace-dpv-mb4-noreserve-r18 45 python tools/train_gpt.py $G13B --seq-len 2048 \
        --timeout 90 --steps 6 --micro-batches 4 --vpp 2 --schedule dualpipev --no-return-outputs --cudagraph --memory-trace
      job trace-dpv-mb4-r18 45 python tools/train_gpt.py $G13B --seq-len 2048 \
        --timeout 90 --steps 6 --micro-batches 4 --vpp 2 --schedule dualpipev --no-return-outputs --cudagraph --memory-trace
      zb_part zb-seq512-mb4-dpv 150 512 4 zero-bubble-seq512-mb4-dualpipev-noret5 135 --schedules dualpipev
    }
    queue_b() {
      job zb-rounds3-r18 290 python tools/bench_rounds.py --name rounds3-zb-seq2048-mb4-noret5 --rounds 3 --budget 270 \
        --base "$G13B --seq-len 2048 --micro-batches 4 --steps 12 --timeout 120 --no-return-outputs" \
        --variant graphed_1f1b="--cudagraph" --variant graphed_zbv="--vpp 2 --schedule zbv --cudagraph"
    } ;;
  19)
    G13B=$G13B_BASE
    noreserve() {  # noreserve CFG...: the benchmark's graphed run of each "name:trainer args", no reserved block
      local cfg
      for cfg in "$@"; do
        # shellcheck disable=SC2086
        FLAGS_graphpp_reserve_pool=0 job "noreserve-${cfg%%:*}-r19" 50 python tools/train_gpt.py $G13B ${cfg#*:} \
          --steps 12 --timeout 120 --profile-steps 3 --no-return-outputs --cudagraph
      done
    }
    queue_a() {
      zb_part zb-seq512-mb8-dpv 160 512 8 zero-bubble-seq512-mb8-dualpipev-noret5 140 --schedules dualpipev
      noreserve "1f1b-mb8:--seq-len 2048 --micro-batches 8" "1f1b-mb4:--seq-len 2048 --micro-batches 4" \
        "dpv-mb4:--seq-len 2048 --micro-batches 4 --vpp 2 --schedule dualpipev" \
        "zbv-mb4:--seq-len 2048 --micro-batches 4 --vpp 2 --schedule zbv" "1f1b-s512-mb8:--seq-len 512 --micro-batches 8"
    }
    queue_b() {
      noreserve "zbv-mb8:--seq-len 2048 --micro-batches 8 --vpp 2 --schedule zbv" \
        "izb-mb8:--seq-len 2048 --micro-batches 8 --vpp 2 --schedule interleaved_zb" \
        "izb-mb4:--seq-len 2048 --micro-batches 4 --vpp 2 --schedule interleaved_zb" \
        "dpv-mb8:--seq-len 2048 --micro-batches 8 --vpp 2 --schedule dualpipev" \
        "zbv-s512-mb8:--seq-len 512 --micro-batches 8 --vpp 2 --schedule zbv"
      # shellcheck disable=SC2086
      job zb-rounds5-r19 "$(budget 5)" python tools/bench_rounds.py --name rounds5-zb-seq2048-mb4-noret5 --rounds 5 \
        --budget "$(budget 30)" --base "$G13B --seq-len 2048 --micro-batches 4 --steps 12 --timeout 120 --no-return-outputs" \
        --variant graphed_1f1b="--cudagraph" --variant graphed_zbv="--vpp 2 --schedule zbv --cudagraph"
    } ;;
  20)
    G13B=$G13B_BASE
    queue_a() { pytest_job tests-pipeline 220 unittests/gpu/test_pipeline_gpu.py; }
    queue_b() {
      pytest_job tests-zero-bubble 120 unittests/gpu/test_zero_bubble_gpu.py
      # shellcheck disable=SC2086
      job zbv-mb8-graphed-r20 50 python tools/train_gpt.py $G13B --seq-len 2048 --micro-batches 8 --vpp 2 \
        --schedule zbv --steps 12 --timeout 120 --profile-steps 3 --no-return-outputs --cudagraph
    } ;;
  21)
    G13B=$G13B_BASE
    queue_a() {
      zb_part zb-seq2048-mb4-r21 280 2048 4 zero-bubble-seq2048-mb4-segments 260
      pytest_job tests-reserve 60 unittests/gpu/test_engine_gpu.py -k reserved_before_capture
    }
    queue_b() {
      zb_part zb-seq2048-mb8-r21 280 2048 8 zero-bubble-seq2048-mb8-segments 260
      # shellcheck disable=SC2086
      job trace-zbv-mb8-r21 45 python tools/train_gpt.py $G13B --seq-len 2048 --timeout 90 --steps 6 --micro-batches 8 \
        --vpp 2 --schedule zbv --no-return-outputs --cudagraph --memory-trace
    } ;;
  22)
    queue_a() {
      zb_part zb-seq512-mb4-r22 240 512 4 zero-bubble-seq512-mb4-segments 220
      pytest_job tests-pipeline 230 unittests/gpu/test_pipeline_gpu.py
    }
    queue_b() {
      zb_part zb-seq512-mb8-r22 240 512 8 zero-bubble-seq512-mb8-segments 220
      zb_part zb-seq2048-mb8-dpv-r22 110 2048 8 zero-bubble-seq2048-mb8-dualpipev-segments 100 --schedules dualpipev
      pytest_job tests-zero-bubble 120 unittests/gpu/test_zero_bubble_gpu.py
      pytest_job tests-engine 100 unittests/gpu/test_engine_gpu.py
    } ;;
  23)
    G13B=$G13B_BASE
    queue_a() {
      zb_part zb-seq2048-mb4-r23 300 2048 4 zero-bubble-seq2048-mb4-whole 285
      pytest_job tests-placement 60 unittests/gpu/test_engine_gpu.py -k "reserved_before_capture or whole"
    }
    queue_b() {
      zb_part zb-seq2048-mb8-r23 300 2048 8 zero-bubble-seq2048-mb8-whole 285
      # shellcheck disable=SC2086
      job trace-dpv-mb4-r23 45 python tools/train_gpt.py $G13B --seq-len 2048 --timeout 90 --steps 6 --micro-batches 4 \
        --vpp 2 --schedule dualpipev --no-return-outputs --cudagraph --memory-trace
    } ;;
  24)
    G13B=$G13B_BASE
    queue_a() {
      zb_part zb-seq2048-mb8-dpv-r24 200 2048 8 zero-bubble-seq2048-mb8-dualpipev-segments 190 --schedules dualpipev
    }
    queue_b() {
      local mode
      for mode in eager graphed; do
        local g=""; [ $mode = graphed ] && g="--cudagraph"
        # shellcheck disable=SC2086
        job "trace-dpv-mb4-$mode-r24" 50 python tools/train_gpt.py $G13B --seq-len 2048 --timeout 90 --steps 6 \
          --micro-batches 4 --vpp 2 --schedule dualpipev --no-return-outputs --memory-trace $g
      done
    } ;;
  25)
    G13B="$G13B_BASE --seq-len 2048 --timeout 90 --steps 6"
    raw() {  # raw NAME LAYOUT TRAINER ARGS...
      local name=$1 layout=$2; shift 2
      # shellcheck disable=SC2086
      FLAGS_graphpp_reserve_pool=$layout GRAPHPP_MEMTRACE_RAW="$R/raw/$name" job "raw-$name" 60 \
        python tools/train_gpt.py $G13B "$@" --no-return-outputs --cudagraph --memory-trace
    }
    queue_a() {
      raw dpv-mb4-segments 1 --micro-batches 4 --vpp 2 --schedule dualpipev
      raw dpv-mb4-block block --micro-batches 4 --vpp 2 --schedule dualpipev
    }
    queue_b() {
      raw zbv-mb4-segments 1 --micro-batches 4 --vpp 2 --schedule zbv
      raw zbv-mb4-block block --micro-batches 4 --vpp 2 --schedule zbv
    } ;;
  26)
    G13B="$G13B_BASE --seq-len 2048 --timeout 90 --steps 6"
    queue_a() {
      # shellcheck disable=SC2086
      FLAGS_graphpp_reserve_pool=0 GRAPHPP_MEMTRACE_RAW="$R/raw/dpv-mb4-none" job raw-dpv-mb4-none 60 \
        python tools/train_gpt.py $G13B --micro-batches 4 --vpp 2 --schedule dualpipev --no-return-outputs --cudagraph --memory-trace
    }
    queue_b() {
      # shellcheck disable=SC2086
      FLAGS_graphpp_reserve_pool=0 GRAPHPP_MEMTRACE_RAW="$R/raw/zbv-mb4-none" job raw-zbv-mb4-none 60 \
        python tools/train_gpt.py $G13B --micro-batches 4 --vpp 2 --schedule zbv --no-return-outputs --cudagraph --memory-trace
    } ;;
  27)
    G13B=$G13B_BASE
    queue_a() { pytest_job tests-pipeline 240 unittests/gpu/test_pipeline_gpu.py; }
    queue_b() {
      pytest_job tests-zero-bubble 110 unittests/gpu/test_zero_bubble_gpu.py
      pytest_job tests-engine 60 unittests/gpu/test_engine_gpu.py
      # shellcheck disable=SC2086
      job zbv-mb4-graphed-r27 50 python tools/train_gpt.py $G13B --seq-len 2048 --micro-batches 4 --vpp 2 \
        --schedule zbv --steps 12 --timeout 120 --profile-steps 3 --no-return-outputs --cudagraph
    } ;;
  28)
    G13B=$G13B_BASE
    queue_a() { pytest_job tests-engine 70 unittests/gpu/test_engine_gpu.py; }
    queue_b() {
      # shellcheck disable=SC2086
      GRAPHPP_MEMTRACE_RAW="$R/raw/zbv-mb4-block-r28" job zbv-mb4-graphed-r28 60 python tools/train_gpt.py $G13B \
        --seq-len 2048 --micro-batches 4 --vpp 2 --schedule zbv --steps 6 --timeout 90 --no-return-outputs --cudagraph \
        --memory-trace
    } ;;
  29)
    pytest_job tests-pool-segments 90 unittests/gpu/test_pool_segments_gpu.py
    if grep -q "rc=0 " "$R/status.txt"; then
      queue_a() {
        zb_part zb-seq2048-mb4 300 2048 4 zero-bubble-seq2048-mb4-expandable 270
        zb_part zb-seq512-mb8 260 512 8 zero-bubble-seq512-mb8-expandable "$(budget)"
      }
      queue_b() {
        zb_part zb-seq2048-mb8 300 2048 8 zero-bubble-seq2048-mb8-expandable 270
        zb_part zb-seq512-mb4 260 512 4 zero-bubble-seq512-mb4-expandable "$(budget)"
      }
    fi ;;
  30)
    queue_a() {
      pytest_job tests-pipeline 250 unittests/gpu/test_pipeline_gpu.py
      pytest_job tests-hf 150 unittests/gpu/test_hf_gpu.py
      pytest_job tests-allreduce 100 unittests/gpu/test_allreduce_gpu.py
    }
    queue_b() {
      pytest_job tests-zero-bubble 120 unittests/gpu/test_zero_bubble_gpu.py
      pytest_job tests-engine-segments 90 unittests/gpu/test_engine_gpu.py unittests/gpu/test_pool_segments_gpu.py
      pytest_job tests-optim-generators 120 unittests/gpu/test_optim_gpu.py unittests/gpu/test_generators_gpu.py
      pytest_job tests-faults 150 unittests/gpu/test_faults_gpu.py
      pytest_job tests-allocator 90 unittests/gpu/test_allocator_gpu.py
    } ;;
  31)
    G13B=$G13B_BASE
    queue_a() {
      job memory-gpt1.3b-r31 200 python tools/bench_pipeline_memory.py --preset gpt1.3b --variants eager,default \
        --rounds 1 --budget 180
      # shellcheck disable=SC2086
      GRAPHPP_MEMTRACE_RAW="$R/raw/zbv-mb4-expandable-r31" job zbv-mb4-raw-r31 60 python tools/train_gpt.py $G13B \
        --seq-len 2048 --micro-batches 4 --vpp 2 --schedule zbv --steps 6 --timeout 90 --no-return-outputs --cudagraph \
        --memory-trace
    }
    queue_b() {
      # shellcheck disable=SC2086
      job zb-rounds3-r31 230 python tools/bench_rounds.py --name rounds3-zb-seq2048-mb4-expandable --rounds 3 \
        --budget 215 --base "$G13B --seq-len 2048 --micro-batches 4 --steps 12 --timeout 120 --no-return-outputs" \
        --variant graphed_1f1b="--cudagraph" --variant graphed_zbv="--vpp 2 --schedule zbv --cudagraph"
    }
    queue_all() {
      job memory-gpt1.3b-pp4-r31 "$(budget 5)" python tools/bench_pipeline_memory.py --preset gpt1.3b-pp4 \
        --variants eager,default --rounds 1 --budget "$(budget 30)"
    } ;;
  32)
    G13B=$G13B_BASE
    queue_a() {
      pytest_job tests-engine-segments 80 unittests/gpu/test_pool_segments_gpu.py unittests/gpu/test_engine_gpu.py
      # shellcheck disable=SC2086
      job zbv-mb4-graphed-r32 60 python tools/train_gpt.py $G13B --seq-len 2048 --micro-batches 4 --vpp 2 \
        --schedule zbv --steps 12 --timeout 120 --profile-steps 3 --no-return-outputs --cudagraph
    }
    queue_b() { pytest_job tests-zero-bubble 120 unittests/gpu/test_zero_bubble_gpu.py; } ;;
  33) queue_a() { pytest_job tests-pool-segments 60 unittests/gpu/test_pool_segments_gpu.py; } ;;
  34) queue_a() { pytest_job tests-engine-segments 80 unittests/gpu/test_pool_segments_gpu.py unittests/gpu/test_engine_gpu.py; } ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac

if [ "$PHASE" = 3 ]; then
  queue_all
elif [ "$GPUS" -ge 4 ]; then
  ( export CUDA_VISIBLE_DEVICES=0,1; queue_a ) &
  ( export CUDA_VISIBLE_DEVICES=2,3; queue_b ) &
  wait
  [ "$PHASE" = 31 ] && queue_all  # after the pairs: all four GPUs
else
  queue_a; queue_b
fi
if [ "$PHASE" = 15 ] && ls benchmarks/results/zero-bubble-seq2048-mb*-noret4-*.json >/dev/null 2>&1; then
  job zb-merge 30 python tools/bench_zero_bubble.py --merge benchmarks/results/zero-bubble-seq2048-mb4-noret4-*.json \
    benchmarks/results/zero-bubble-seq2048-mb8-noret4-*.json --speed-rounds benchmarks/results/rounds3-zb-seq2048-mb4-noret-h200.json \
    --name zero-bubble-seq2048-no-return-outputs-third
fi
if [ "$PHASE" = 14 ] && ls benchmarks/results/zero-bubble-seq2048-mb*-noret3-*.json >/dev/null 2>&1; then
  job zb-merge 30 python tools/bench_zero_bubble.py --merge benchmarks/results/zero-bubble-seq2048-mb4-noret3-*.json \
    benchmarks/results/zero-bubble-seq2048-mb8-noret3-*.json --speed-rounds benchmarks/results/rounds3-zb-seq2048-mb4-noret-h200.json \
    --name zero-bubble-seq2048-no-return-outputs-third
fi
if [ "$PHASE" = 9 ] && ls benchmarks/results/zero-bubble-seq2048-mb*-noret-*.json >/dev/null 2>&1; then
  job zb-merge 30 python tools/bench_zero_bubble.py --merge benchmarks/results/zero-bubble-seq2048-mb4-noret-*.json \
    benchmarks/results/zero-bubble-seq2048-mb8-noret-*.json --name zero-bubble-seq2048-no-return-outputs
fi
if [ "$PHASE" = 2 ] && ls benchmarks/results/zero-bubble-seq*-*.json >/dev/null 2>&1; then
  job zb-merge 60 python tools/bench_zero_bubble.py --merge benchmarks/results/zero-bubble-seq2048-*.json \
    benchmarks/results/zero-bubble-seq512-*.json
fi

mkdir -p "$R/results"
find benchmarks/results -newer "$R/.start" -type f -exec cp {} "$R/results/" \;
tar czf "$DEST/run.tgz" -C "$R" .
cp "$R/status.txt" "$DEST/status.txt" 2>/dev/null
echo "== env"; cat "$R/env.txt"
echo "== progress"; cat "$R/progress.txt" 2>/dev/null
echo "== status"; cat "$R/status.txt" 2>/dev/null
for f in "$R"/logs/*.log; do
  echo "== $(basename "$f") (tail)"; grep -v "^\s*$" "$f" | tail -n 14 | cut -c1-260
done
echo "== results"; ls "$R/results"
