#!/usr/bin/env bash
# gpu_session.sh — what one call on the GPU machine usually needs, in one command
# (device time is short and every call starts a fresh machine): build, then the parts
# named on the command line, logs and results under $OUT (default /tmp/mok-out). The
# device tool brings back at most 8 files, so each part's files go into one archive,
# $OUT/<part>.tar, when the part ends (`tar -xf` to read them; the file names below
# are inside it); a part cut short by a time limit leaves only what it printed.
#
#   bench/gpu_session.sh test trace bench          # all three, in this order
#   SHAPES=deepseek-v3 bench/gpu_session.sh trace  # traces of one shape
#
#   test          make test-gpu (its last line printed; killed after TEST_LIMIT s, default
#                 420: a hang then still leaves its log's last lines, not a silent call)
#   trace         MOK_TRACE of one step per shape, bench/trace_report.py per shape
#   kernel-times  bench_moe.py --kernel-times (the GPU's kernel time inside a step)
#   bench         bench_moe.py, every routing of five shapes (all but kimi-k2; SHAPES
#                 sets them), JSON in $OUT/bench.json
#                 (BENCH_ROUNDS=N: mok and the peer timed N times a row, in turn;
#                 BENCH_ARGS: more bench_moe.py options, e.g. --recompute-gate-up)
#   variants      bench_moe.py --variants: mok's step with every variant off and with each
#                 of shapes.VARIANTS on, in turn, ROUNDS times (default 2), STEPS steps a
#                 timing (default 10); JSON in $OUT/variants.json (docs/PERF.md's cost table)
#   test-refs     each of TEST_REFS's builds (build-NAME directories from build_refs.sh,
#                 space-separated): its mok_gpu_tests (the C GPU suites, comm included),
#                 the last line and what failed; for telling which of several branches
#                 breaks a merge of them, in one call (each bounded by TEST_LIMIT too, as
#                 is comm)
#   comm          the 2-GPU cases alone (suite comm: the NCCL exchange, the forward and
#                 a step at W = 2 against the CPU and bitwise against W = 1, capacity,
#                 timeout)
#   ep            bench/bench_ep.py: mok and the torch all-to-all peer at W = 1 and
#                 W = RANKS (default 2), same tokens per GPU; JSON in $OUT/bench-ep.json
#   p2p           bench/p2p_copy.py: the copy engine's peer-to-peer GB/s, GPU 0 to each
#                 other GPU, then every GPU to the next at once (the NVLink figure the
#                 EP bandwidths are set against); JSON in $OUT/p2p.json
#   ep-trace      MOK_TRACE of one step per EP shape (EP_SHAPES) at W = 1 and at W = RANKS,
#                 a trace file per rank ($OUT/ep-trace-<shape>-w<W>.txt.rank<r>), and
#                 bench/trace_report.py's span, per-kind times and waits of each
#   ep-ab         mok check --ranks 1,RANKS (tiny shape: D3 and the CPU) of each build, then
#                 mok bench at W = RANKS (default 2) of REF's mok commands (build-NAME/mok
#                 from bench/build_refs.sh; a space-separated list; an entry
#                 path@VAR=value runs that build with the variable, e.g.
#                 build-split/mok@MOK_DISPATCH_STREAMS=64) and this one's,
#                 alternating, ROUNDS times (default 2), EP_SHAPES; then this one at
#                 W = 1: forward, backward and step ms a line (MOK_DISPATCH_STREAMS
#                 passes through)
#   ep-example    examples/train_moe_lm.py --ep RANKS (STEPS_LM steps, default 40): one
#                 process twice, then torchrun on RANKS GPUs twice, each later run with
#                 --compare against the first (its verdict line), curves and PNG in $OUT
#   repeat        one GPU test case (CASE, default gpu.racecheck) REPEAT times (default 20),
#                 each bounded by `timeout` (LIMIT s, default 30), for a rare failure or
#                 hang: one line a run (exit 124: it hung), then the counts; logs in
#                 $OUT/repeat-<i>.txt of a failed run (and its sanitizer logs beside it)
#   ab            mok alone (bench_moe.py --mok-only, uniform routing; SKEWED=1: skewed
#                 too), REF's libraries
#                 (builds of other commits or flags, carried; a space-separated list) and
#                 this one, alternating, ROUNDS times (even rounds in the reverse order):
#                 variants compared in one call, at the same temperature; each line ends
#                 with a digest of mok's outputs' bits (equal: the builds agree bit for bit)
#                 (REF=build-ref/libmok.so by default; ROUNDS=2 by default;
#                 bench/build_refs.sh builds other commits' libraries here)
#   stalls        a MOK_STALL_PROFILE build (build-stall/, or STALL_DIR's: thread 0's cycles in
#                 each wait of the GEMM tasks, by kind) traced per shape, beside the plain
#                 trace's rates
#   peer-cycles   the peer's six grouped GEMMs per shape under ncu, FLOPs per SM cycle
#                 (bench/peer_cycles.py; compare with trace's "% of peak per cycle")
#   block-cycles  SM cycles a K block of each GEMM kind at several token counts, for the
#                 first shape of SHAPES (bench/block_cycles.py; TOKENS=4096,8192,16384)
#   micro         the GPU microbenchmarks (bench/micro/: conversion pipes, wgmma ring)
#   engine        build/micro/engine_gemm once per ENGINE_ARGS entry (';'-separated, default
#                 "--gather;--gather-scaled;--dh": A gathered by the producer, as is and
#                 scaled on the way, then dh's epilogue; the entry
#                 "plain": no flags, the plain cases; "@build-NAME flags": that build's
#                 engine_gemm, e.g. an experiment's -D flag), each run's output in
#                 $OUT/engine<i>.txt, bounded by ENGINE_LIMIT s (default 240; a hung wait
#                 reports itself after 2 s)
#   engine-ncu    ncu over engine_gemm's kernels on one case (ENGINE_NCU_ARGS, default
#                 "--wgrad --case deepseek-v3 dW13"; ENGINE_NCU_KERNELS, default the --wgrad
#                 control and the first engine it runs): the tensor pipe's share, L2 and
#                 DRAM, and warp stalls per SASS instruction (bench/ncu_sass_report.py)
#   phase-ncu     ncu over the backward running only its weight gradients (MOK_KNOBS 64),
#                 then only dx (128) (PHASE_KNOBS: another list, e.g. 256 = DG alone), for
#                 the first shape of SHAPES: the tensor pipe's
#                 active share, L2 hit rate and traffic by source, DRAM bytes, shared-
#                 memory bank conflicts, and warp stalls per SASS instruction
#                 ($OUT/ncu-phase-*-sass.csv.gz, read with bench/ncu_sass_report.py) of
#                 each phase alone (PHASE_KNOBS=0: the whole backward)
#   dram          ncu's DRAM bytes read and written, L2 hit rate and tensor-pipe share of
#                 one forward, then of the backward running only dh (MOK_KNOBS 512) and
#                 only dx (128), for the first shape of SHAPES (DRAM_RUNS: other
#                 knob:kernel entries, e.g. "64:moe_backward"; DRAM_METRICS: more ncu
#                 metrics, comma-separated); set them against each tensor's bytes once
#                 (docs/PERF.md, nineteenth session)
# WARM=S: trace, stalls and kernel-times first run S seconds of back-to-back steps, so
# that the measured steps run at a sustained run's clock (default 0: from idle).
# COMMIT (default: git rev-parse, or "?" on a tree without .git) labels the bench. Pass it:
# on 2026-12-06 git rev-parse in the device machine's copy of the tree answered the
# session's first commit (a4a6cde) for a tree and library at 1885960.
# Example, built here and carried: make build/libmok.so build/mok_gpu_tests, then the
# device tool with carry ["build/libmok.so", "build/mok_gpu_tests"] runs
# PREBUILT=1 COMMIT=<sha> bench/gpu_session.sh test bench
set -u
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
RESULTS=${OUT:-/tmp/mok-out}   # <part>.tar of each part; the parts write into OUT
OUT=$(mktemp -d /tmp/mok-part-XXXXXX)
# bench's default: issue 35's five shapes but kimi-k2 (65 GiB a step: a call of its own);
# the other parts' default: the four with SonicMoE's 2026-12-01 figures
BENCH_SHAPES=${SHAPES:-qwen3-30b-a3b,gpt-oss-120b,deepseek-v3,qwen3.5,mixtral-8x7b}
SHAPES=${SHAPES:-qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b,deepseek-v3}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
cd "$(dirname "$0")/.."
mkdir -p "$RESULTS"

# PREBUILT=1: use build/libmok.so and build/mok_gpu_tests as they came (built on the
# CPU machine from this tree and sent with the device tool's carry; saves the ~40 s
# build of device time), make taking them as up to date.
TEST_GPU="make test-gpu"
if [ -n "${PREBUILT:-}" ] && [ -f build/libmok.so ] && [ -f build/mok_gpu_tests ]; then
  echo "prebuilt build/libmok.so and build/mok_gpu_tests"
  TEST_GPU="make -o build/libmok.so -o build/mok_gpu_tests test-gpu"
else
  make -j"$(nproc)" build/libmok.so build/mok_gpu_tests > "$RESULTS/build.log" 2>&1 || {
    tail -30 "$RESULTS/build.log"
    exit 1
  }
fi
export MOK_LIBRARY="${MOK_LIBRARY:-$PWD/build/libmok.so}"  # (set: e.g. dram of a build-NAME)
# libnccl.so.2 for binaries built elsewhere (carried): their build-time NCCL path is the
# CPU machine's; Python's nvidia-nccl has the library here
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)  # peer-cycles, phase-ncu, dram, engine-ncu
# one kernel's rates and traffic under ncu (phase-ncu, engine-ncu): time, cycles, the tensor
# pipe's share, L2 hit rate, DRAM bytes, shared-memory bank conflicts
NCU_RATES=gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
NCU_RATES=$NCU_RATES,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum
NCU_RATES=$NCU_RATES,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
# phase-ncu, dram: four mok steps of SHAPES' first shape, for ncu (which takes the 4th launch)
NCU_STEPS="import sys; sys.path.insert(0, 'bench'); import bench_moe as B, torch
pb = B.Problem('${SHAPES%%,*}')
for _ in range(4): pb.mok_step()
torch.cuda.synchronize()"

# trace_shapes NAME: MOK_TRACE of one step per shape with the library in $MOK_LIBRARY,
# into $OUT/NAME-<shape>.txt(.gz), bench/trace_report.py's report beside it, its rates,
# clocks and (a MOK_STALL_PROFILE build) stall shares printed.
trace_shapes() {
  for s in ${SHAPES//,/ }; do
    rm -f "$OUT/$1-$s.txt"
    MOK_TRACE="$OUT/$1-$s.txt" python3 bench/bench_moe.py --profile --uniform-only --shapes "$s" \
      --warm "${WARM:-0}" > /dev/null 2>&1
    python3 bench/trace_report.py "$OUT/$1-$s.txt" --shape "$s" > "$OUT/$1-report-$s.txt" 2>&1
    echo "== $s ($1)"
    grep -E "span|TFLOP|waiting|clock" "$OUT/$1-report-$s.txt"
    gzip -f "$OUT/$1-$s.txt"
  done
}
# test_verdict LABEL STATUS LOG: the run's last line, and what failed (here too: the
# device tool brings back only a few files)
test_verdict() {
  echo "$1 (exit $2): $(tail -1 "$3")"
  if [ "$2" -eq 137 ]; then
    echo "$1: killed after TEST_LIMIT=$TEST_LIMIT s (a hang?); the log's last lines:"
    tail -20 "$3"
  elif [ "$2" -ne 0 ]; then
    grep -B8 "^FAIL" "$3" | tail -60
  fi
}
TEST_LIMIT=${TEST_LIMIT:-420}
export PYTHONUNBUFFERED=1  # (a part cut by a time limit keeps the rows it printed)
for part in "$@"; do
  case "$part" in
    test)
      timeout -s KILL "$TEST_LIMIT" $TEST_GPU > "$OUT/test-gpu.log" 2>&1
      test_verdict test-gpu $? "$OUT/test-gpu.log"
      ;;
    test-refs)
      for dir in ${TEST_REFS:-}; do
        timeout -s KILL "$TEST_LIMIT" "$dir/mok_gpu_tests" > "$OUT/test-refs-$dir.log" 2>&1
        test_verdict "$dir/mok_gpu_tests" $? "$OUT/test-refs-$dir.log"
      done
      ;;
    trace)
      trace_shapes trace
      ;;
    kernel-times)
      python3 bench/bench_moe.py --kernel-times --shapes "$SHAPES" --warm "${WARM:-0}" 2>&1 | tee "$OUT/kernel-times.txt"
      ;;
    bench)
      python3 bench/bench_moe.py --shapes "$BENCH_SHAPES" --commit "$COMMIT" --json "$OUT/bench.json" \
        --rounds "${BENCH_ROUNDS:-1}" ${BENCH_ARGS:-} 2>&1 |
        tee "$OUT/bench.txt"
      ;;
    variants)
      python3 bench/bench_moe.py --variants --shapes "$SHAPES" --steps "${STEPS:-10}" --rounds "${ROUNDS:-2}" \
        --commit "$COMMIT" --json "$OUT/variants.json" 2>&1 | tee "$OUT/variants.txt"
      ;;
    ab)
      REF=${REF:-build-ref/libmok.so}
      for round in $(seq "${ROUNDS:-2}"); do
        # odd rounds REF's libraries first, even rounds this one first, so that an even
        # ROUNDS puts each first equally often (an order effect of up to about 1% could
        # not be told from a build's: docs/PERF.md, sixth 2026-12-05 session)
        libs="$REF build/libmok.so"
        [ $((round % 2)) -eq 0 ] && libs="build/libmok.so $REF"
        for lib in $libs; do
          echo "== ab round $round: $lib" | tee -a "$OUT/ab.txt"
          # a build with its own bench/ and python/ (build_refs.sh's tree.tar) runs them:
          # another commit's binding may not load this one's library, nor this one its
          tree=$PWD dir=$(dirname "$lib")
          if [ -f "$dir/tree.tar" ]; then
            tree=/tmp/ab-tree-$(basename "$dir")
            [ -d "$tree" ] || { mkdir -p "$tree" && tar -xf "$dir/tree.tar" -C "$tree"; }
          fi
          (cd "$tree" && MOK_LIBRARY="$OLDPWD/$lib" python3 bench/bench_moe.py --mok-only \
            $([ -n "${SKEWED:-}" ] || echo --uniform-only) --shapes "$SHAPES" --commit "$lib" 2>&1) |
            grep --line-buffered -v "^-\|^shape" | tee -a "$OUT/ab.txt"
        done
      done
      ;;
    ep-trace)
      [ -x build/mok ] || make -j"$(nproc)" build/mok > "$OUT/build-mok.log" 2>&1
      for s in $(echo "${EP_SHAPES:-qwen3-30b-a3b,deepseek-v3}" | tr , " "); do
        for w in 1 "${RANKS:-2}"; do
          base="$OUT/ep-trace-$s-w$w.txt"
          rm -f "$base" "$base".rank*
          MOK_TRACE="$base" ./build/mok bench --backend cuda --ranks "$w" --shape "$s" --steps 1 > /dev/null 2>&1 ||
            echo "ep-trace: mok bench --ranks $w --shape $s failed"
          for f in "$base" "$base".rank*; do
            [ -f "$f" ] || continue
            python3 bench/trace_report.py "$f" --shape "$s" > "$f.report" 2>&1
            echo "== $s W = $w: ${f##*/}"
            grep -E "span|TFLOP|waiting" "$f.report"
            gzip -f "$f"
          done
        done
      done
      ;;
    ep-ab)
      [ -x build/mok ] || make -j"$(nproc)" build/mok > "$OUT/build-mok.log" 2>&1
      run_mok() {  # REF entry (path, or path@VAR=value: run with that variable), then mok's arguments
        local entry=$1
        shift
        if [[ $entry == *@* ]]; then env "${entry#*@}" "${entry%%@*}" "$@"; else "$entry" "$@"; fi
      }
      ep_bench() {  # label mok W shape
        run_mok "$2" bench --backend cuda --ranks "$3" --shape "$4" --steps "${STEPS:-3}" --json "$OUT/ep-ab.json" \
          > "$OUT/ep-ab-run.txt" 2>&1 || { echo "$1 $4 W = $3 failed: $(tail -1 "$OUT/ep-ab-run.txt")"; return; }
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('%-24s %-15s W=%s fwd %7.3f bwd %7.3f step %7.3f' % (sys.argv[2], sys.argv[3], sys.argv[4], d['forward_ms'], d['backward_ms'], d['step_ms']))" \
          "$OUT/ep-ab.json" "$1" "$4" "$3" | tee -a "$OUT/ep-ab.txt"
      }
      for m in ${REF:-} build/mok; do  # each build's D3 first: W = 1 and RANKS against the CPU, bitwise
        run_mok "$m" check --backend cuda --ranks "1,${RANKS:-2}" --shape tiny > "$OUT/ep-ab-check.txt" 2>&1
        echo "$m check (exit $?): $(tail -1 "$OUT/ep-ab-check.txt")" | tee -a "$OUT/ep-ab.txt"
      done
      for s in $(echo "${EP_SHAPES:-qwen3-30b-a3b,deepseek-v3}" | tr , " "); do
        for round in $(seq "${ROUNDS:-2}"); do
          for m in ${REF:-} build/mok; do ep_bench "$m" "$m" "${RANKS:-2}" "$s"; done
        done
        ep_bench build/mok build/mok 1 "$s"
      done
      ;;
    ep-example)
      lm="examples/train_moe_lm.py --ep ${RANKS:-2} --steps ${STEPS_LM:-40}"
      run_lm() {  # name, then python3 or torchrun's arguments before the script, then the script's extra arguments
        local name=$1
        shift
        "$@" > "$OUT/$name.txt" 2>&1 || tail -20 "$OUT/$name.txt"
      }
      tr="python3 -m torch.distributed.run --standalone --nproc_per_node ${RANKS:-2}"
      # one process twice (the second must repeat the first's bits), then torchrun on RANKS
      # GPUs twice, each against the one-process curve
      run_lm lm-ep1 python3 $lm --curve "$OUT/lm-ep1.json"
      run_lm lm-ep1b python3 $lm --curve "$OUT/lm-ep1b.json" --compare "$OUT/lm-ep1.json"
      run_lm lm-ep2 $tr $lm --curve "$OUT/lm-ep2.json" --compare "$OUT/lm-ep1.json" --png "$OUT/lm-ep.png"
      run_lm lm-ep2b $tr $lm --curve "$OUT/lm-ep2b.json" --compare "$OUT/lm-ep1.json"
      grep -E "final loss|bitwise|differs" "$OUT"/lm-ep1.txt "$OUT"/lm-ep1b.txt "$OUT"/lm-ep2.txt "$OUT"/lm-ep2b.txt
      ;;
    comm)
      timeout -s KILL "$TEST_LIMIT" ./build/mok_gpu_tests -k comm 2>&1 | tail -40
      ;;
    p2p)
      python3 bench/p2p_copy.py --json "$OUT/p2p.json" 2>&1 | tee "$OUT/p2p.txt"
      ;;
    ep)
      [ -x build/mok ] || make -j"$(nproc)" build/mok > "$OUT/build-mok.log" 2>&1
      python3 bench/bench_ep.py --ranks "${RANKS:-2}" --shapes "${EP_SHAPES:-qwen3-30b-a3b,deepseek-v3}" \
        --json "$OUT/bench-ep.json" 2>&1 | tee "$OUT/bench-ep.txt"
      ;;
    repeat)
      ok=0 failed=0 hung=0
      for i in $(seq "${REPEAT:-20}"); do
        timeout "${LIMIT:-30}" ./build/mok_gpu_tests -k "${CASE:-gpu.racecheck}" > "$OUT/repeat-$i.txt" 2>&1
        rc=$?
        pkill -f compute-sanitizer  # (a hung racecheck leaves its child behind)
        if [ $rc -ne 0 ]; then
          for f in sanitizer_*.log; do [ -f "$f" ] && cp "$f" "$OUT/repeat-$i-$f"; done
        fi
        echo "repeat $i: exit $rc, $(tail -1 "$OUT/repeat-$i.txt")"
        [ $rc -ne 0 ] || rm "$OUT/repeat-$i.txt"  # (kept for failures only: few files come back)
        if [ $rc -eq 0 ]; then ok=$((ok + 1)); elif [ $rc -eq 124 ]; then hung=$((hung + 1)); else failed=$((failed + 1)); fi
      done
      echo "repeat ${CASE:-gpu.racecheck}: $ok passed, $failed failed, $hung hung"
      ;;
    stalls)
      # (NVFLAGS from the environment: the Makefile appends its own flags to it.) STALL_DIR:
      # a stall build carried under another name (e.g. with an experiment's flag too),
      # used as it came
      dir=${STALL_DIR:-build-stall}
      if [ -z "${PREBUILT:-}" ] || [ ! -f "$dir/libmok.so" ]; then
        NVFLAGS="-O3 -DMOK_STALL_PROFILE" LOCAL_MEM_OK=1 make -j"$(nproc)" BUILD="$dir" \
          "$dir/libmok.so" \
          > "$OUT/build-stall.log" 2>&1 || { tail -30 "$OUT/build-stall.log"; exit 1; }
      fi
      MOK_LIBRARY="$PWD/$dir/libmok.so" trace_shapes stalls
      ;;
    peer-cycles)
      for s in ${SHAPES//,/ }; do
        $NCU --clock-control none --kernel-name device_kernel --csv \
          --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second \
          python3 bench/peer_cycles.py --run "$s" > "$OUT/ncu-peer-$s.csv" 2> "$OUT/ncu-peer-$s.err"
        python3 bench/peer_cycles.py --report "$OUT/ncu-peer-$s.csv" --shape "$s"
      done
      ;;
    block-cycles)
      python3 bench/block_cycles.py --shape "${SHAPES%%,*}" --tokens "${TOKENS:-4096,8192,16384}" 2>&1 |
        grep -v "^mok profile\|one step$" | tee "$OUT/block-cycles.txt"
      ;;
    phase-ncu)
      # each phase alone (MOK_KNOBS 64: weight gradients, 128: dx) under ncu, kernel
      # replay of the 4th backward launch: (1) rates and traffic, (2) L2 traffic by
      # source (the other L2 partition's share), (3) warp-state sampling per SASS
      # instruction. Separate runs: one metric name this ncu lacks fails only its run.
      NCU_ARGS="--clock-control none --kernel-name regex:moe_backward --launch-skip 3 --launch-count 1"
      M1=$NCU_RATES
      M2=lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex_lookup_hit.sum
      for knob in ${PHASE_KNOBS:-64 128}; do
        echo "== MOK_KNOBS=$knob"
        for m in M1 M2; do
          MOK_KNOBS=$knob $NCU $NCU_ARGS --csv --metrics "${!m}" python3 -c "$NCU_STEPS" \
            > "$OUT/ncu-phase-$knob-$m.csv" 2> "$OUT/ncu-phase-$knob-$m.err"
          grep moe_backward "$OUT/ncu-phase-$knob-$m.csv" | awk -F'","' '{print $(NF-2), $(NF-1), $NF}'
        done
        MOK_KNOBS=$knob $NCU $NCU_ARGS --section WarpStateStats --section SourceCounters \
          -o "$OUT/ncu-phase-$knob" python3 -c "$NCU_STEPS" > "$OUT/ncu-phase-$knob-src.log" 2>&1
        $NCU -i "$OUT/ncu-phase-$knob.ncu-rep" --page details --csv > "$OUT/ncu-phase-$knob-details.csv" 2>&1
        $NCU -i "$OUT/ncu-phase-$knob.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/ncu-phase-$knob-sass.csv" 2>&1
        grep -i "stall\|warp cycles" "$OUT/ncu-phase-$knob-details.csv" | awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | head -40
        # (the report is too large to come back; the per-instruction CSV, compressed, does)
        rm -f "$OUT/ncu-phase-$knob.ncu-rep"
        gzip -f "$OUT/ncu-phase-$knob-sass.csv"
      done
      ;;
    dram)
      # a few metrics, so each run is one short replay
      M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
      M=$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg
      M=$M${DRAM_METRICS:+,$DRAM_METRICS}  # (more metrics, comma-separated: more replays)
      for run in ${DRAM_RUNS:-0:moe_forward 512:moe_backward 128:moe_backward}; do
        knob=${run%%:*} kernel=${run#*:}
        echo "== MOK_KNOBS=$knob $kernel"
        MOK_KNOBS=$knob $NCU --clock-control none --kernel-name "regex:$kernel" --launch-skip 3 --launch-count 1 \
          --csv --metrics "$M" python3 -c "$NCU_STEPS" > "$OUT/dram-$knob-$kernel.csv" 2> "$OUT/dram-$knob-$kernel.err"
        grep "$kernel" "$OUT/dram-$knob-$kernel.csv" | awk -F'","' '{print $(NF-2), $(NF-1), $NF}'
      done
      ;;
    micro)
      make -j"$(nproc)" micro > "$OUT/build-micro.log" 2>&1 || { tail -20 "$OUT/build-micro.log"; exit 1; }
      for m in build/micro/*; do echo "== $m"; "$m"; done 2>&1 | tee "$OUT/micro.txt"
      ;;
    engine)
      make build/micro/engine_gemm > "$OUT/build-engine.log" 2>&1 || { tail -20 "$OUT/build-engine.log"; exit 1; }
      i=0
      IFS=';' read -ra engine_runs <<< "${ENGINE_ARGS:---gather;--gather-scaled;--dh}"
      for args in "${engine_runs[@]}"; do
        bin=build/micro/engine_gemm
        if [ "${args#@}" != "$args" ]; then  # "@build-NAME flags": that build's engine_gemm
          bin=${args%% *} args=${args#"$bin"} bin=${bin#@}/micro/engine_gemm
        fi
        [ "${args# }" = plain ] && args=""
        echo "== $bin $args"
        # shellcheck disable=SC2086  # (the flags split on purpose)
        timeout "${ENGINE_LIMIT:-240}" "$bin" $args 2>&1 | tee "$OUT/engine$i.txt" | grep -v "^  cuBLAS"
        i=$((i + 1))
      done
      ;;
    engine-ncu)
      # each kernel of ENGINE_NCU_KERNELS (regexes, space-separated; default: the --wgrad
      # control and the first engine it runs) under ncu on one case of engine_gemm
      # (ENGINE_NCU_ARGS, default "--wgrad --case deepseek-v3 dW13"; "--case" takes the rest
      # of the line), its third launch (past the two checked ones): rates, then warp-state
      # sampling per SASS instruction ($OUT/ncu-engine-<i>-sass.csv.gz, bench/ncu_sass_report.py);
      # the memory tables' shared-memory rows are in ncu-engine-<i>-details.csv
      make build/micro/engine_gemm > "$OUT/build-engine.log" 2>&1 || { tail -20 "$OUT/build-engine.log"; exit 1; }
      ncu_args=${ENGINE_NCU_ARGS:---wgrad --case deepseek-v3 dW13}
      flags=${ncu_args%%--case *} case_name=""
      [ "$flags" != "$ncu_args" ] && case_name=${ncu_args#*--case }
      i=0
      for k in ${ENGINE_NCU_KERNELS:-wgrad_tiles_kernel engine_gemm_kernel}; do
        echo "== ncu $k: engine_gemm $flags${case_name:+--case $case_name}"
        na=(--clock-control none --kernel-name "regex:$k" --launch-skip 2 --launch-count 1)
        # shellcheck disable=SC2086  # (the flags split on purpose)
        timeout "${ENGINE_LIMIT:-240}" $NCU "${na[@]}" --csv --metrics "$NCU_RATES" build/micro/engine_gemm $flags \
          ${case_name:+--case "$case_name"} > "$OUT/ncu-engine-$i.csv" 2> "$OUT/ncu-engine-$i.err"
        grep -E "\"$k" "$OUT/ncu-engine-$i.csv" | awk -F'","' '{print $(NF-2), $(NF-1), $NF}'
        # shellcheck disable=SC2086
        timeout "${ENGINE_LIMIT:-240}" $NCU "${na[@]}" --section WarpStateStats --section SourceCounters \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
          -o "$OUT/ncu-engine-$i" build/micro/engine_gemm \
          $flags ${case_name:+--case "$case_name"} > "$OUT/ncu-engine-$i-src.log" 2>&1
        $NCU -i "$OUT/ncu-engine-$i.ncu-rep" --page details --csv > "$OUT/ncu-engine-$i-details.csv" 2>&1
        grep -i -E "throughput|shared|stall|warp cycles" "$OUT/ncu-engine-$i-details.csv" |
          awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | head -30
        $NCU -i "$OUT/ncu-engine-$i.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-engine-$i-sass.csv" 2>&1
        python3 bench/ncu_sass_report.py "$OUT/ncu-engine-$i-sass.csv" 2>&1 | head -30
        rm -f "$OUT/ncu-engine-$i.ncu-rep"
        gzip -f "$OUT/ncu-engine-$i-sass.csv"
        i=$((i + 1))
      done
      ;;
    *)
      echo "gpu_session.sh: unknown part '$part' (test, trace, kernel-times, bench, variants, comm, stalls, ab, peer-cycles, block-cycles, micro, engine, engine-ncu, phase-ncu, dram)"
      exit 2
      ;;
  esac
  # this part's files, one archive (named by the part, or part-2 when it comes again)
  tarball="$RESULTS/$part.tar" n=1
  while [ -e "$tarball" ]; do n=$((n + 1)) tarball="$RESULTS/$part-$n.tar"; done
  if [ -n "$(ls -A "$OUT")" ]; then
    tar -cf "$tarball" -C "$OUT" . && rm -rf "${OUT:?}"/*
  fi
done
rmdir "$OUT" 2>/dev/null
