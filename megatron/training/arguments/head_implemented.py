"""Megatron-LM options this library implements: each changes what it changes in Megatron-LM (tested).

Options named by their flag string are defined by the group files (``*_args.py``); see registry.py for how an
option moves here from the other two tables.
"""
from megatron.training.arguments.model_args import int_pair, layer_pattern
from megatron.training.arguments.registry import Block, names, negated, no_or_disable, switch, value
from megatron.training.arguments.registry import OptionClass as C

IMPLEMENTED = C.IMPLEMENTED

SIGNALS = tuple(range(1, 32)) + (34, 64)  # HEAD's --exit-signal choices

BLOCKS = (
    Block(
        IMPLEMENTED,
        "today's Megatron-LM training options",
        (
            value("--num-virtual-stages-per-pipeline-rank", type=int,
                  help="Virtual pipeline stages per pipeline rank (interleaved schedule); the other way to say "
                       "--num-layers-per-virtual-pipeline-stage (give one of the two)."),
            switch("--disable-bf16-reduced-precision-matmul",
                   help="Make bf16 matmuls reduce in full precision "
                        "(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False)."),
            value("--exit-signal", type=int, default=15, choices=SIGNALS,
                  help="The signal --exit-signal-handler catches (default 15, SIGTERM)."),
            value("--wandb-entity", help="Weights & Biases entity (team or user) of --wandb-project's run."),
            value("--logging-level", type=int,
                  help="Level of the Python root logger (logging.DEBUG = 10, INFO = 20, ...); not given: unchanged."),
            switch("--use-dist-ckpt", dest="use_dist_ckpt_deprecated",
                   help="Deprecated: --ckpt-format torch_dist (the default)."),
            value("--dist-ckpt-format", dest="dist_ckpt_format_deprecated",
                  help="Deprecated: --ckpt-format FORMAT."),
            value("--start-eval-at-iter", type=int,
                  help="No periodic evaluation before this iteration (--eval-interval's evaluations start there)."),
        ),
        group="training",
    ),
    Block(
        IMPLEMENTED,
        "Megatron-LM's YAML form of the configuration (yaml_args.py)",
        (
            value("--yaml-cfg", help="Read the run's settings from this YAML file (language_model: TransformerConfig "
                                     "fields, model_parallel: ModelParallelConfig fields, other keys: arguments by "
                                     "dest; ${VAR} from the environment) instead of the command line."),
        ),
        group="experimental",
    ),
    Block(
        IMPLEMENTED,
        "fully sharded data parallelism (megatron/core/distributed/fsdp, torch_fully_sharded_data_parallel.py)",
        (
            switch("--use-torch-fsdp2", help="Shard parameters, gradients and optimizer state over the data-parallel "
                   "(x context-parallel) ranks with PyTorch's FSDP2 (fully_shard): each transformer layer, the "
                   "embedding and the output layer is a unit. Needs --no-gradient-accumulation-fusion, "
                   "--untie-embeddings-and-output-weights and --ckpt-format torch_dist or torch_dcp."),
            negated("--torch-fsdp2-no-reshard-after-forward", dest="torch_fsdp2_reshard_after_forward",
                    help="FSDP2: keep each unit's gathered weights from its forward to its backward pass."),
            switch("--use-megatron-fsdp", help="Megatron-FSDP: shard what --data-parallel-sharding-strategy says over "
                   "the data-parallel (x context-parallel) ranks, experts over the expert data-parallel ranks; "
                   "checkpoints in --ckpt-format fsdp_dtensor. Turns --use-distributed-optimizer on (version 1)."),
            value("--data-parallel-sharding-strategy", default="optim_grads_params",
                  choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
                  help="Megatron-FSDP: no_shard (DDP), optim (ZeRO-1: optimizer state and main weights), "
                       "optim_grads (ZeRO-2: also gradients), optim_grads_params (ZeRO-3: also weights)."),
            value("--megatron-fsdp-version", type=int, default=1, choices=(1, 2),
                  help="Megatron-FSDP version (1, which turns --use-distributed-optimizer on)."),
            value("--megatron-fsdp-main-params-dtype", default="fp32", choices=("fp32", "bf16", "fp16", "auto"),
                  help="Megatron-FSDP main weights dtype (fp32)."),
            value("--megatron-fsdp-main-grads-dtype", default="auto", choices=("fp32", "bf16", "fp16", "auto"),
                  help="Megatron-FSDP main gradients: auto (as --accumulate-allreduce-grads-in-fp32 says, fp32 with "
                       "--bf16), fp32, or bf16 (as --grad-reduce-in-bf16; FSDP2's sharded gradients stay fp32)."),
            value("--megatron-fsdp-grad-comm-dtype", default="auto", choices=("fp32", "fp16", "bf16", "auto"),
                  help="Megatron-FSDP gradient communication dtype: auto (the main gradients'), fp32, or bf16 (as "
                       "--grad-reduce-in-bf16)."),
            no_or_disable("strict-fsdp-dtensor-load", help="fsdp_dtensor: load what the checkpoint has and report "
                          "the model keys it lacks (per --dist-ckpt-strictness) instead of stopping."),
        ) + names("""--init-model-with-meta-device"""),
        group="fsdp",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--tensor-model-parallel-size --pipeline-model-parallel-size --sequence-parallel
              --context-parallel-size --expert-model-parallel-size --expert-tensor-parallel-size
              --cp-comm-type --num-layers-per-virtual-pipeline-stage --model-parallel-size
              --no-overlap-p2p-communication"""),
        group="model parallelism",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--num-layers --encoder-num-layers --decoder-num-layers --hidden-size --ffn-hidden-size
              --num-attention-heads --kv-channels --group-query-attention --num-query-groups
              --max-position-embeddings --position-embedding-type --use-rotary-position-embeddings
              --rotary-base --rotary-percent --rotary-interleaved --rotary-seq-len-interpolation-factor
              --use-rope-scaling --rope-scaling-factor --no-position-embedding --make-vocab-size-divisible-by
              --norm-epsilon --apply-layernorm-1p --apply-residual-connection-post-layernorm --openai-gelu
              --squared-relu --swiglu --onnx-safe --bert-no-binary-head --untie-embeddings-and-output-weights
              --normalization --qk-layernorm --add-qkv-bias --disable-bias-linear --attention-backend
              --transformer-impl --hidden-dropout --attention-dropout --fp32-residual-connection
              --apply-query-key-layer-scaling --attention-softmax-in-fp32 --init-method-std
              --init-method-xavier-uniform --seed --data-parallel-random-init --no-initialization
              --use-cpu-initialization --use-flash-attn --use-mcore-models"""),
        group="model",
    ),
    Block(
        IMPLEMENTED,
        "hybrid Mamba models (megatron/core/ssm/, megatron/core/models/mamba/, pretrain_mamba.py; docs/models.md)",
        names("""--hybrid-layer-pattern --hybrid-override-pattern --is-hybrid-model --mamba-state-dim --mamba-head-dim
              --mamba-num-groups --mamba-num-heads --disable-mamba-mem-eff-path --mamba-training-ssm-states-dtype
              --moe-latent-size"""),
        group="hybrid",
    ),
    Block(
        IMPLEMENTED,
        "a Hugging Face tokenizer directory may run its own code (transformers' trust_remote_code)",
        names("""--trust-remote-code"""),
        group="tokenizer",
    ),
    Block(
        IMPLEMENTED,
        "gpt-oss (megatron/core/transformer/attention_variants.py, mlp.py)",
        names("""--glu-linear-offset --activation-func-clamp-value --softmax-type""") + (
            switch("--quick-geglu", help="Gated MLP whose gate's activation is quick GeLU, x * sigmoid(1.702 x) "
                                         "(gpt-oss)."),
            value("--window-size", type=int_pair,
                  help="Sliding-window attention 'left,right': query i sees keys i-left .. i+right (-1: unbounded); "
                       "gpt-oss: 127,0."),
            value("--window-attn-skip-freq", type=layer_pattern,
                  help="Which layers use --window-size: all (not given), those whose number (from 1) is not a "
                       "multiple of N, or a 0/1 list expression per layer (1 = windowed)."),
        ),
        group="network size",
    ),
    Block(
        IMPLEMENTED,
        "Llama 4 (megatron/core/transformer/attention.py, moe/moe_layer.py)",
        names("""--qk-l2-norm --moe-apply-probs-on-input""") + (
            value("--no-rope-freq", type=layer_pattern,
                  help="Layers without rotary embeddings: every N-th layer (counted from 1), or a 0/1 list expression "
                       "per layer (1 = no RoPE); Llama 4: 4."),
        ),
        group="network size",
    ),
    Block(
        IMPLEMENTED,
        "multi-latent attention (megatron/core/transformer/multi_latent_attention.py) and YaRN rotary embeddings",
        names("""--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim
              --v-head-dim --rope-type --rotary-scaling-factor --mscale --mscale-all-dim
              --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow
              --yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int"""),
        group="model",
    ),
    Block(
        IMPLEMENTED,
        "heterogeneous (Nemotron-NAS / Llama-Nemotron) per-layer configurations "
        "(megatron/core/transformer/heterogeneous/, megatron/core/models/gpt/heterogeneous/)",
        (
            value("--heterogeneous-layers-config-path",
                  help="JSON file with a \"block_configs\" list (one entry per layer, Hugging Face's Nemotron-NAS "
                       "format): each layer's attention (query groups, no-op, or one linear layer) and MLP (hidden "
                       "size, no-op, or one linear layer); pretrain_gpt.py builds the GPT from it."),
            value("--heterogeneous-layers-config-encoded-json",
                  help="The text of that JSON file (read from --heterogeneous-layers-config-path when not given; "
                       "kept in the checkpoint's args)."),
        ),
        group="heterogeneous architecture",
    ),
    Block(
        IMPLEMENTED,
        "the experimental attention variants: DeepSeek sparse attention "
        "(megatron/core/transformer/experimental_attention_variant/dsa.py) and Gated DeltaNet "
        "(megatron/core/ssm/gated_delta_net.py), built by megatron-core's experimental-attention-variant block spec",
        names("""--experimental-attention-variant --dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk
              --dsa-indexer-loss-coeff --dsa-indexer-use-sparse-loss --linear-conv-kernel-dim --linear-key-head-dim
              --linear-value-head-dim --linear-num-key-heads --linear-num-value-heads""") + (
            value("--linear-attention-freq", type=layer_pattern,
                  help="Gated DeltaNet layers: every layer but each N-th (int N, counted from 1), or a 0/1 list "
                       "expression per layer (1 = Gated DeltaNet, 0 = standard attention)."),
        ),
        group="transformer configuration",
    ),
    Block(
        IMPLEMENTED,
        "megatron-core's config logger (megatron/core/config_logger.py)",
        names("""--config-logger-dir"""),
        group="transformer configuration",
    ),
    Block(
        IMPLEMENTED,
        "multi-token prediction (megatron/core/transformer/multi_token_prediction.py)",
        names("""--mtp-num-layers --mtp-loss-scaling-factor"""),
        group="transformer configuration",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion
              --no-bias-dropout-fusion --no-rope-fusion --cross-entropy-loss-fusion
              --no-gradient-accumulation-fusion"""),
        group="fusions",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--num-experts --moe-layer-freq --moe-ffn-hidden-size --moe-shared-expert-intermediate-size
              --moe-shared-expert-gate --moe-grouped-gemm --moe-layer-recompute
              --moe-router-load-balancing-type --moe-router-dtype --moe-router-score-function
              --moe-router-topk --moe-router-pre-softmax --moe-router-num-groups --moe-router-group-topk
              --moe-router-topk-scaling-factor --moe-router-enable-expert-bias --moe-router-bias-update-rate
              --moe-aux-loss-coeff --moe-z-loss-coeff --moe-input-jitter-eps --moe-per-layer-logging
              --moe-token-dispatcher-type --moe-expert-capacity-factor --moe-pad-expert-input-to-capacity
              --moe-token-drop-policy --moe-router-force-load-balancing --moe-enable-routing-replay"""),
        group="mixture of experts",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--fp16 --bf16 --loss-scale --initial-loss-scale --min-loss-scale --loss-scale-window
              --hysteresis --accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16 --fp16-lm-cross-entropy
              --fp8-format --fp8-recipe --fp8-margin --fp8-interval --fp8-amax-history-len
              --fp8-amax-compute-algo --no-fp8-wgrad --first-last-layers-bf16 --num-layers-at-start-in-bf16
              --num-layers-at-end-in-bf16"""),
        group="precision",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--micro-batch-size --global-batch-size --batch-size --rampup-batch-size
              --step-batch-size-schedule --train-iters --train-samples --exit-interval --exit-duration-in-mins
              --exit-signal-handler --manual-gc --manual-gc-interval --no-manual-gc-eval
              --recompute-activations --recompute-granularity --recompute-method --recompute-num-layers
              --distribute-saved-activations --recompute-modules --checkpoint-activations
              --calculate-per-token-loss --deterministic-mode --empty-unused-memory-level
              --no-check-for-nan-in-loss-and-grad --optimizer --dataloader-type --weight-decay
              --start-weight-decay --end-weight-decay --weight-decay-incr-style --clip-grad --adam-beta1
              --adam-beta2 --adam-eps --sgd-momentum --lr --lr-decay-style --lr-decay-iters --lr-decay-samples
              --lr-warmup-fraction --lr-warmup-iters --lr-warmup-samples --lr-warmup-init --warmup --min-lr
              --decoupled-lr --decoupled-min-lr --override-opt_param-scheduler
              --use-checkpoint-opt_param-scheduler"""),
        group="training",
    ),
    Block(
        IMPLEMENTED,
        "the rerun state machine (megatron/core/rerun_state_machine.py) and --fake-process-group",
        names("""--rerun-mode --error-injection-rate --error-injection-type --check-for-spiky-loss
              --check-for-large-grads --result-rejected-tracker-filename --iterations-to-skip
              --fake-process-group"""),
        group="rerun engine",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--distributed-backend --distributed-timeout-minutes --lazy-mpu-init
              --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size --overlap-param-gather
              --overlap-param-gather-with-optimizer-step --no-align-param-gather --local-rank --log-straggler
              --straggler-minmax-count"""),
        group="distributed",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--save --save-interval --load --finetune --pretrained-checkpoint --ckpt-step
              --use-checkpoint-args --exit-on-missing-checkpoint --ckpt-format --auto-detect-ckpt-format
              --async-save --dist-ckpt-strictness --no-save-optim --no-save-rng --no-load-optim --no-load-rng
              --ckpt-fully-parallel-save"""),
        group="checkpointing",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--data-path --split --train-data-path --valid-data-path --test-data-path --data-cache-path
              --no-mmap-bin-files --mock-data --seq-length --encoder-seq-length --decoder-seq-length
              --mask-prob --short-seq-prob --num-workers --reset-position-ids --reset-attention-mask
              --eod-mask-loss --no-create-attention-mask-in-dataloader --vocab-size --padded-vocab-size
              --no-pad-vocab-size --vocab-file --merge-file --vocab-extra-ids --tokenizer-type
              --tokenizer-model --tiktoken-pattern --tiktoken-num-special-tokens --eval-iters --eval-interval
              --skip-train"""),
        group="data",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--log-interval --log-params-norm --log-throughput --timing-log-level --timing-log-option
              --tensorboard-dir --tensorboard-log-interval --tensorboard-queue-size
              --log-timers-to-tensorboard --no-log-loss-scale-to-tensorboard
              --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad
              --no-barrier-with-level-1-timing --log-world-size-to-tensorboard --wandb-project
              --wandb-exp-name --wandb-save-dir --profile --profile-step-start --profile-step-end
              --use-pytorch-profiler --profile-ranks --adlr-autoresume --adlr-autoresume-interval
              --output-bert-embeddings"""),
        group="logging",
    ),
    Block(
        IMPLEMENTED,
        "",
        names("""--DDP-impl --check-for-nan-in-loss-and-grad --no-query-key-layer-scaling
              --no-async-tensor-model-parallel-allreduce --overlap-p2p-communication
              --pipeline-model-parallel-split-rank --standalone-embedding-stage --use-legacy-models
              --embedding-weights-in-fp32 --log-batch-size-to-tensorboard --no-log-learnig-rate-to-tensorboard
              --tiktoken-special-tokens --bias-gelu-fusion --bias-swiglu-fusion --apply-rope-fusion
              --hang-timeout-minutes"""),
        group="2023", head=False,
    ),
)
