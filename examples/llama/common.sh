# Shared by the scripts here: the launcher and the data/tokenizer flags.
# Override with the environment: NPROC (GPUs per node), NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT, DATA_PATH (a preprocessed indexed dataset prefix),
# TOKENIZER (a Hugging Face tokenizer.json), CKPT (checkpoint directory: load
# and save; start it with python -m megatronapp.convert import-hf).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-8}"
LAUNCH=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --nnodes "${NNODES:-1}"
        --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}"
        --master-port "${MASTER_PORT:-29500}" "$ROOT/examples/pretrain_gpt.py")
DATA=()
if [[ -n "${DATA_PATH:-}" ]]; then DATA+=(--data-path "$DATA_PATH"); fi
if [[ -n "${TOKENIZER:-}" ]]; then
  DATA+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER")
fi
CKPT_FLAGS=()
if [[ -n "${CKPT:-}" ]]; then CKPT_FLAGS+=(--load "$CKPT" --save "$CKPT" --save-interval 500); fi
