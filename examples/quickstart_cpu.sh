#!/usr/bin/env bash
# Quickstart: train a small GPT on the corpus that ships with the project, on CPU, save it, generate text.
#
#   bash examples/quickstart_cpu.sh            # 2 processes (data parallel), gloo, ~5 minutes on 2 cores
#
# Steps: tokenise data/stdlib_prose.jsonl.gz with the shipped GPT-2 BPE files (tools/preprocess_data.py),
# then `torchrun pretrain_gpt.py` with Megatron's flags. Checkpoints go to $OUT/checkpoints in Megatron's
# layout (iter_0000100/mp_rank_00/model_optim_rng.pt), then tools/generate_text.py completes a prompt from it.
# Set NPROC, ITERS or OUT to change the run; PROMPT and GEN_TOKENS for the generation.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/quickstart}
NPROC=${NPROC:-2}
ITERS=${ITERS:-100}
VOCAB=data/tokenizers/gpt2/vocab.json
MERGES=data/tokenizers/gpt2/merges.txt
DATA="$OUT/stdlib_gpt2_text_document"
mkdir -p "$OUT"

if [ ! -f "$DATA.idx" ]; then
  echo "== tokenising the shipped corpus into $DATA.{bin,idx}"
  python tools/preprocess_data.py --input data/stdlib_prose.jsonl.gz --output-prefix "$OUT/stdlib_gpt2" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod --workers 2
fi

# CPU run even on a machine with a GPU (drop this line and --distributed-backend to use NCCL).
export MEGATRON_FORCE_CPU=1

GPT_ARGS=(
  --num-layers 6 --hidden-size 256 --num-attention-heads 8
  --seq-length 256 --max-position-embeddings 256
  --micro-batch-size 4 --global-batch-size 16
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --init-method-std 0.02
  --train-iters "$ITERS"
)
DATA_ARGS=(
  --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 98,2,0 --num-workers 0
)
OUTPUT_ARGS=(
  --log-interval 10 --log-throughput --eval-interval 50 --eval-iters 4
  --save "$OUT/checkpoints" --save-interval "$ITERS"
)

echo "== training a 6-layer GPT on $NPROC CPU process(es)"
torchrun --nproc-per-node "$NPROC" pretrain_gpt.py "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
  --distributed-backend gloo
echo "== done: checkpoint in $OUT/checkpoints (latest iteration: $(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt"))"

# Check the trained model by generating text from the saved checkpoint (one process, the same model flags).
# The full log (arguments, checkpoint loading) goes to $OUT/generate.log; only the prompt and the text are shown.
echo "== generating text from $OUT/checkpoints (tools/generate_text.py)"
if python tools/generate_text.py "${GPT_ARGS[@]}" --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --load "$OUT/checkpoints" --distributed-backend gloo --out-seq-length "${GEN_TOKENS:-48}" --top_k 20 \
    --temperature 0.8 --prompt "${PROMPT:-The function returns}" > "$OUT/generate.log" 2>&1; then
  sed -n '/^== prompt/,$p' "$OUT/generate.log"
else
  tail -n 30 "$OUT/generate.log"
  echo "== text generation failed (full log: $OUT/generate.log)"
  exit 1
fi
