#!/usr/bin/env bash
# The released artifacts as a user gets them (make test-install; part of make test):
#  1. the wheel carries a manylinux tag (auditwheel show);
#  2. it installs into a fresh virtual environment (torch from the pip cache);
#  3. its console entry point trains on 2 ranks outside the checkout, with the
#     bundled corpus (no --data-path);
#  4. a C++ trainer builds against the installed CMake package and runs;
#  5. the sdist builds a wheel in that clean environment.
#
# The work folder is the same for every checkout of this machine (outside the
# checkout, locked against a second install test at the same time): compiler
# caches (ccache, which the project's CMake and the consumer build use) key
# on absolute paths, so the sdist's build and the consumer's hit the cache
# whenever their sources are unchanged, from any clone.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
WORK=${MAPP_INSTALL_TEST_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/megatronapp/install-test}
mkdir -p "$WORK"
exec 9> "$WORK.lock"
flock 9
find "$WORK" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
echo "install test in $WORK"
wheel=$(ls "$ROOT"/dist/megatronapp-*manylinux*.whl | head -n 1)
sdist=$(ls "$ROOT"/dist/megatronapp-*.tar.gz | head -n 1)

echo "== 1. tag: $(basename "$wheel") [${SECONDS}s]"
"$ROOT/.venv/bin/auditwheel" show "$wheel" > "$WORK/auditwheel.txt"
grep -o '"manylinux_2_[0-9]*_x86_64"' "$WORK/auditwheel.txt" | head -n 1

echo "== 2. fresh virtual environment [${SECONDS}s]"
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --upgrade pip
# --no-compile: no bytecode for torch's thousands of modules (half of this step's
# minute; Python compiles what it imports anyway).
"$WORK/venv/bin/python" -m pip install -q --no-compile "$wheel"
"$WORK/venv/bin/megatronapp-info" > "$WORK/info.txt"
sed -n 1p "$WORK/info.txt"

echo "== 3. megatronapp-pretrain on 2 ranks, outside the checkout [${SECONDS}s]"
run=$(mktemp -d)
port=$("$WORK/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
trap 'rm -rf "$run"' EXIT
(cd "$run" && OMP_NUM_THREADS=1 "$WORK/venv/bin/torchrun" --nproc-per-node 2 \
   --master-addr 127.0.0.1 --master-port "$port" "$WORK/venv/bin/megatronapp-pretrain" \
   --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
   --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --eval-iters 1 \
   --no-progress --output-dir out)
"$WORK/venv/bin/python" - "$run/out/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["tp"] == 2 and s["iterations"] == 3 and s["final_loss"] < s["first_loss"], s
print(f"trained: loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
PY

echo "== 4. C++ trainer against the installed package [${SECONDS}s]"
prefix=$("$WORK/venv/bin/python" -c 'import megatronapp; print(megatronapp.cmake_prefix_path)')
torch_prefix=$("$WORK/venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
# The consumer and the C++ examples, copied out of the checkout.
mkdir -p "$WORK/consumer-src/tests" "$WORK/consumer-src/examples"
cp -rp tests/consumer_torch "$WORK/consumer-src/tests/"
cp -rp examples/cpp "$WORK/consumer-src/examples/"
launcher=$(command -v ccache || true)
cmake -S "$WORK/consumer-src/tests/consumer_torch" -B "$WORK/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_PREFIX_PATH=$prefix;$torch_prefix" -DTORCH_CUDA_ARCH_LIST=9.0 \
  ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher} > "$WORK/consumer.log"
cmake --build "$WORK/consumer" >> "$WORK/consumer.log"
"$WORK/consumer/consumer_torch"
# The custom C++ trainer built out of tree, on 2 ranks launched by hand.
port=$("$WORK/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=""
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$WORK/consumer/train_tp_mlp" 2 50 > "$WORK/train_tp_mlp.$r.log" 2>&1 &
  pids="$pids $!"
done
for p in $pids; do wait "$p"; done
grep "step 50 loss" "$WORK/train_tp_mlp.0.log"

echo "== 5. the sdist builds a wheel in the clean environment [${SECONDS}s]"
"$WORK/venv/bin/python" -m pip install -q scikit-build-core setuptools-scm
mkdir -p "$WORK/sdist"
tar -xzf "$sdist" -C "$WORK/sdist"
# A fixed name (not megatronapp-<version>): the same paths, so the same cache keys.
src=$WORK/sdist/src
mv "$WORK"/sdist/megatronapp-*/ "$src"
MAPP_BUILD_TESTS=OFF "$WORK/venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps \
  -C build-dir=build/py -w "$WORK/from-sdist" "$src"
ls "$WORK"/from-sdist/megatronapp-*.whl
echo "install test passed [${SECONDS}s]"
