"""The argument lists today's Megatron-LM example scripts hand to their training script, as data.

Each list is what bash passes after the script path, word for word, read from the script at the named commit of
NVIDIA/Megatron-LM. Only the paths are placeholders (``{CKPT}``, ``{TB}``, ``{VOCAB}``, ``{MERGE}``, ``{DATA}``,
``{TOKENIZER_MODEL}``, ``{CACHE}``), filled with temporary files by the test. Shell quirks are kept: the llama
script's data flags are array elements like ``"--split '99,1,0'"`` expanded unquoted, so bash splits them on
spaces and the value keeps its single quotes (``'99,1,0'``).
"""

GPT3_175B = dict(
    script="examples/gpt3/train_gpt3_175b_distributed.sh", commit="157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9",
    entry="pretrain_gpt.py",
    argv="""
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
    --attention-backend auto
    --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 --train-iters 500000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
    --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path {DATA} --vocab-file {VOCAB} --merge-file {MERGE} --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --save {CKPT} --load {CKPT} --eval-iters 10
    --tensorboard-dir {TB}
    """)

LLAMA3_8B_FP8_MOCK = dict(
    script="examples/llama/train_llama3_8b_h100_fp8.sh", commit="157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9",
    entry="pretrain_gpt.py",
    argv="""
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
    --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
    --untie-embeddings-and-output-weights --disable-bias-linear
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
    --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {CACHE} --tiktoken-pattern v2
    --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
    --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
    --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
    --save {CKPT} --load {CKPT} --tensorboard-dir {TB}
    """)

# The same script with a tokenizer and a data prefix given (its "real data" branch).
LLAMA3_8B_FP8_DATA = dict(
    LLAMA3_8B_FP8_MOCK,
    argv=LLAMA3_8B_FP8_MOCK["argv"].replace(
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path {CACHE} "
        "--tiktoken-pattern v2\n    --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files "
        "--num-workers 1",
        "--data-path {DATA} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {TOKENIZER_MODEL} "
        "--data-cache-path {CACHE}\n    --split '99,1,0' --no-create-attention-mask-in-dataloader "
        "--no-mmap-bin-files --num-workers 1 --vocab-size 128256"))

BERT_340M = dict(
    script="examples/bert/train_bert_340m_distributed.sh", commit="157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9",
    entry="pretrain_bert.py",
    argv="""
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --max-position-embeddings 512
    --attention-backend auto
    --micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0 --fp16
    --lr 0.0001 --lr-decay-iters 990000 --lr-decay-style linear --min-lr 1.0e-5 --weight-decay 1e-2
    --lr-warmup-fraction .01 --clip-grad 1.0
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path {DATA} --vocab-file {VOCAB} --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --save {CKPT} --load {CKPT} --eval-iters 10
    --tensorboard-dir {TB}
    """)

T5_220M = dict(
    script="examples/t5/train_t5_220m_distributed.sh", commit="157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9",
    entry="pretrain_t5.py",
    argv="""
    --encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 --kv-channels 64
    --ffn-hidden-size 3072 --encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512
    --micro-batch-size 64 --global-batch-size 512 --lr 0.0001 --train-iters 1000000 --lr-decay-iters 1000000
    --lr-decay-style linear --min-lr 0.00001 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16
    --vocab-extra-ids 100 --init-method-std 0.015 --transformer-impl transformer_engine
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --attention-backend auto
    --data-path {DATA} --vocab-file {VOCAB} --tokenizer-type BertWordPieceCase --split 99982,9,9
    --log-interval 100 --tensorboard-dir {TB} --save-interval 500 --eval-interval 1000 --eval-iters 10
    --distributed-backend nccl --save {CKPT} --load {CKPT}
    """)

MIXTRAL_8X7B = dict(
    script="examples/mixtral/train_mixtral_8x7b_distributed.sh", commit="9b8acfd0dbf72a3c831ddff8e2c07c48b59f3901",
    entry="pretrain_gpt.py",
    argv="""
    --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
    --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
    --no-position-embedding --rotary-base 1000000
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
    --tokenizer-type Llama2Tokenizer --tokenizer-model {TOKENIZER_MODEL} --data-path {DATA} --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
    --use-distributed-optimizer --sequence-parallel
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {CKPT} --load {CKPT}
    --tensorboard-dir {CKPT}/tensorboard --no-load-optim --no-load-rng
    """)

TODAYS_SCRIPTS = {
    "gpt3_175b": GPT3_175B,
    "llama3_8b_fp8_mock": LLAMA3_8B_FP8_MOCK,
    "llama3_8b_fp8_data": LLAMA3_8B_FP8_DATA,
    "bert_340m": BERT_340M,
    "t5_220m": T5_220M,
    "mixtral_8x7b": MIXTRAL_8X7B,
}


def argv_of(entry: dict, paths: dict) -> list:
    """The script's words with the placeholders replaced by ``paths`` (bash word splitting: on whitespace)."""
    return [word.format(**paths) for word in entry["argv"].split()]
