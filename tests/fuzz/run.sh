#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for
# RUNS executions (default 200000) from a small seed corpus:
#   tests/fuzz/run.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-200000}
OUT=build/fuzz
mkdir -p "$OUT"
FLAGS="-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude"
clang++ $FLAGS tests/fuzz/schedule_fuzz.cc src/pipeline/*.cc -o "$OUT/schedule_fuzz"
clang++ $FLAGS tests/fuzz/alloc_trace_fuzz.cc src/memory/trace.cc src/memory/pool.cc src/memory/pool_segments.cc src/memory/pool_validate.cc \
  src/memory/host_device.cc src/common/tunables.cc src/common/log.cc -lspdlog -lfmt \
  -o "$OUT/alloc_trace_fuzz"
python3 tests/fuzz/seeds.py "$OUT"
for t in schedule_fuzz alloc_trace_fuzz; do
  echo "== $t: $RUNS runs"
  "$OUT/$t" -runs="$RUNS" -max_len=4096 -seed=1 "$OUT/corpus_$t" 2>&1 | tail -3
done
