#!/usr/bin/env bash
# Quickstart: train a small GPT on the corpus that ships with the project, on CPU, save it, generate text.
#
#   bash examples/quickstart_cpu.sh      # one process using every core, about 4.7 minutes of training on 2 idle cores
#
# Steps: tokenise data/stdlib_prose.jsonl.gz (documents in a fixed random order, so that the 2 % validation split
# is a random sample) with the shipped GPT-2 BPE files (tools/preprocess_data.py), then
# `torchrun pretrain_gpt.py` with Megatron's flags (a 4-layer GPT, hidden 256, sequence 128, 16 sequences per
# step, 500 steps = 1.02 M tokens seen, a little over one pass over the corpus's 0.93 M tokens; no dropout: one
# pass does not overfit, and dropout costs about 15 % of a CPU step; no attention mask from the dataloader, as in
# today's Megatron scripts: the causal mask is implicit), then tools/quickstart_report.py prints
# the loss curve as a table and writes $OUT/loss.png, and tools/generate_text.py completes three prompts from the
# saved checkpoint. The validation loss starts at 9.0 (ln 8192, uniform over the vocabulary).
#
# Outputs under $OUT (default runs/quickstart): train.log, loss.png (needs matplotlib), tensorboard/ (event
# files; needs the tensorboard package: `pip install -e ".[quickstart]"` installs both; without them the run
# says so and carries on), checkpoints/ in Megatron's `torch` layout (iter_0000500/mp_rank_00/model_optim_rng.pt;
# --ckpt-format torch is passed explicitly to training and generation, so the run does not depend on the
# default format), generate.log (the full generation output; the display below collapses runs of blank lines).
#
# Environment: NPROC (processes, default 1: one process with THREADS torch threads has no gradient all-reduce
# and one copy of the model and optimizer; NPROC=2 runs two gloo ranks, data parallel), THREADS (torch threads
# per process, default: cores / NPROC; set explicitly because torchrun sets OMP_NUM_THREADS=1), ITERS (500),
# OUT, LOG_INTERVAL (25), EVAL_INTERVAL (100), PROMPTS (prompts separated by '|'), GEN_TOKENS (40).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/quickstart}
NPROC=${NPROC:-1}
CORES=$(python -c "import os; print(len(os.sched_getaffinity(0)))")
THREADS=${THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}
ITERS=${ITERS:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
LOG_INTERVAL=${LOG_INTERVAL:-25}
PROMPTS=${PROMPTS:-"The function returns|This module provides|If the argument is"}
VOCAB=data/tokenizers/gpt2/vocab.json
MERGES=data/tokenizers/gpt2/merges.txt
DATA="$OUT/stdlib_gpt2_text_document"
mkdir -p "$OUT"

if [ ! -f "$DATA.idx" ]; then
  # The corpus is ordered by source (docstrings, comments, then the language-reference topics) and --split takes
  # contiguous document ranges, so the last 2 % would be reference topics only. A fixed random document order
  # makes the validation documents a random sample of the corpus.
  echo "== shuffling the shipped corpus's documents (seed 1234) into $OUT/stdlib_prose_shuffled.jsonl"
  python -c "import gzip, random, sys; lines = gzip.open(sys.argv[1], 'rt', encoding='utf-8').readlines(); \
random.Random(1234).shuffle(lines); open(sys.argv[2], 'w', encoding='utf-8').writelines(lines)" \
    data/stdlib_prose.jsonl.gz "$OUT/stdlib_prose_shuffled.jsonl"
  echo "== tokenising it into $DATA.{bin,idx}"
  python tools/preprocess_data.py --input "$OUT/stdlib_prose_shuffled.jsonl" --output-prefix "$OUT/stdlib_gpt2" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod --workers 2
fi

# CPU run even on a machine with a GPU (drop this line and --distributed-backend to use NCCL).
export MEGATRON_FORCE_CPU=1
export OMP_NUM_THREADS=$THREADS

GPT_ARGS=(
  --num-layers 4 --hidden-size 256 --num-attention-heads 8
  --seq-length 128 --max-position-embeddings 128
  --micro-batch-size $(( 16 / NPROC > 0 ? 16 / NPROC : 1 )) --global-batch-size 16
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters $(( ITERS / 20 ))
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --init-method-std 0.02
  --attention-dropout 0.0 --hidden-dropout 0.0 --no-create-attention-mask-in-dataloader
  --train-iters "$ITERS" --ckpt-format torch
)
DATA_ARGS=(
  --data-path "$DATA" --vocab-file "$VOCAB" --merge-file "$MERGES" --split 98,2,0 --num-workers 0
)
OUTPUT_ARGS=(
  --log-interval "$LOG_INTERVAL" --log-throughput --eval-interval "$EVAL_INTERVAL" --eval-iters 12
  --tensorboard-dir "$OUT/tensorboard" --log-validation-ppl-to-tensorboard
  --save "$OUT/checkpoints" --save-interval "$ITERS"
)

echo "== training a 4-layer GPT: $NPROC CPU process(es) x $THREADS thread(s), $ITERS iterations (log: $OUT/train.log)"
start=$(date +%s)
# The console shows the iteration and validation lines; the whole output (arguments, timers) is in train.log.
if ! torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    --distributed-backend gloo 2>&1 | tee "$OUT/train.log" \
    | { grep --line-buffered -E "^ (iteration|validation loss)|WARNING|rror" || true; }; then
  tail -n 30 "$OUT/train.log"
  echo "== training failed (full log: $OUT/train.log)"
  exit 1
fi
echo "== trained in $(( $(date +%s) - start )) s: checkpoint in $OUT/checkpoints (latest iteration:" \
  "$(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt")), TensorBoard files in $OUT/tensorboard"
python tools/quickstart_report.py --train-log "$OUT/train.log" --plot "$OUT/loss.png"

# Check the trained model by generating text from the saved checkpoint (one process, the same model flags).
# The full log (arguments, checkpoint loading) goes to $OUT/generate.log; only the prompts and the text are shown.
echo "== generating text from $OUT/checkpoints (tools/generate_text.py)"
PROMPT_ARGS=()
IFS='|' read -r -a PROMPT_LIST <<< "$PROMPTS"
for p in "${PROMPT_LIST[@]}"; do PROMPT_ARGS+=(--prompt "$p"); done
# A free port for the one-process group (the default, 6000, may be taken by another job on this machine).
GEN_PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
if MASTER_PORT=$GEN_PORT python tools/generate_text.py "${GPT_ARGS[@]}" --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --load "$OUT/checkpoints" --distributed-backend gloo --out-seq-length "${GEN_TOKENS:-40}" --top_k 20 \
    --temperature 0.7 "${PROMPT_ARGS[@]}" > "$OUT/generate.log" 2>&1; then
  python tools/quickstart_report.py --train-log "$OUT/train.log" --generate-log "$OUT/generate.log" --samples-only
else
  tail -n 30 "$OUT/generate.log"
  echo "== text generation failed (full log: $OUT/generate.log)"
  exit 1
fi
