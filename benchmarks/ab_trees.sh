#!/bin/bash
# Before/after step time of two commits' Python packages on the same build,
# round-robin (what benchmarks/RESULTS.md's "One engine" section ran):
#
#   benchmarks/ab_trees.sh BEFORE AFTER "<pretrain flags>" [repeats]
#   benchmarks/ab_trees.sh 22aa252 HEAD "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" 6
#   benchmarks/ab_trees.sh 22aa252 HEAD checkpoint      # benchmarks/checkpoint_bench.py instead
#
# The flags come last, so they may override the model (--num-layers 4
# --hidden-size 256 --num-attention-heads 8 --seq-length 256, micro-batch 2,
# global batch 16, 25 iterations).
#
# Each commit's python/megatronapp is unpacked into a scratch directory with
# the installed extension (_C, lib/) and imported from there (the editable
# install's finder is bypassed), so both run against the same C++ build: valid
# while the older Python only uses entry points the build still has.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1 AFTER=$2 CFG=$3 REPEATS=${4:-3}
PY=.venv/bin/python
SP=$($PY -c "import megatronapp, os; print(os.path.dirname(megatronapp._C.__file__))")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
for v in before after; do
  rev=$([ $v = before ] && echo "$BEFORE" || echo "$AFTER")
  mkdir -p "$WORK/$v"
  git archive "$rev" python/megatronapp | tar -x -C "$WORK/$v"
  cp -r "$SP"/_C*.so "$SP/lib" "$SP/_build_info.py" python/megatronapp/_version.py \
    "$WORK/$v/python/megatronapp/"
  cat > "$WORK/$v/run.py" <<PYEOF
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
sys.path.insert(0, "$WORK/$v/python")
import megatronapp
assert megatronapp.__file__.startswith("$WORK/$v/"), megatronapp.__file__
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
PYEOF
done
for rep in $(seq "$REPEATS"); do
  for v in before after; do
    if [ "$CFG" = checkpoint ]; then
      echo "== $v $rep"
      $PY "$WORK/$v/run.py" benchmarks/checkpoint_bench.py --kills 3 --repeats 3 2>&1 |
        grep -E "^(ours|dcp|DCP|async)"
      continue
    fi
    out="$WORK/out-$v-$rep"
    .venv/bin/torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29631 \
      "$WORK/$v/run.py" examples/pretrain_gpt.py --num-layers 4 --hidden-size 256 \
      --num-attention-heads 8 --seq-length 256 --micro-batch-size 2 --global-batch-size 16 \
      --lr 3e-4 --train-iters 25 --eval-iters 0 --no-progress --log-interval 1000 \
      --output-dir "$out" $CFG > "$out.log" 2>&1 || { tail -20 "$out.log"; exit 1; }
    $PY - "$out/loss.csv" "$v" "$rep" <<'PYEOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
t = [float(r["seconds"]) for r in rows][5:]
print(f"{sys.argv[2]} {sys.argv[3]}: median step {statistics.median(t) * 1000:.1f} ms, "
      f"last loss {rows[-1]['loss']}")
PYEOF
  done
done
