"""Theoretical memory of one rank for a configuration given as Megatron's validated ``args``.

Counts, for the most loaded rank of each pipeline stage, what this library allocates:

* weights: the model parameters (fp32, or fp16/bf16 with ``--fp16`` / ``--bf16``);
* gradients: the DDP gradient buffer (fp32 with ``--bf16`` or ``--accumulate-allreduce-grads-in-fp32``,
  otherwise the parameter dtype);
* optimizer state: Adam's two fp32 moments, plus for fp16/bf16 the fp32 main parameters and, when the
  gradient buffer is not fp32, the fp32 copies of the gradients. With ``--use-distributed-optimizer`` all of
  it is sharded over the ``d`` data-parallel ranks. That gives Megatron's bytes per parameter:
  fp16 20 -> 4 + 16/d, bf16 18 -> 6 + 12/d, fp32 16 -> 8 + 8/d;
* activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
  per layer and micro-batch ``s b h (34 + 5 a s / h)`` bytes with 16-bit activations, divided by ``t`` with
  sequence parallelism, without the ``5 a s / h`` attention-score term under selective recompute (and with
  a fused attention kernel, which never stores the scores), ``2 s b h`` per layer under full recompute;
  times the micro-batches in flight on the first pipeline stage (``pp``, at most the number of micro-batches;
  ``(1 + (pp - 1) / (pp vpp))`` more with the interleaved schedule).

Fully sharded data parallelism (``--use-megatron-fsdp --data-parallel-sharding-strategy S``, ``--use-torch-fsdp2``
= ``optim_grads_params``) over ``d = DP x CP`` ranks, per parameter, with ``P`` the compute bytes (2 for fp16/bf16,
4 for fp32) and ``M`` the optimizer's moments (8 for Adam):

==================== ======== ============= ===================================================================
strategy             weights  grads         optimizer
==================== ======== ============= ===================================================================
no_shard (DDP)       P        4 (or P)      M (+ 4 fp32 main with P = 2, + 4 fp32 grad copies with fp16 grads)
optim (ZeRO-1)       P        4 (or P)      the same / d (Megatron's distributed optimizer)
optim_grads (ZeRO-2) P        4 / d         (4 + M) / d: FSDP2's sharded fp32 parameter is the main weight
optim_grads_params   0        4 / d         (4 + M) / d; each unit's weights are gathered just in time
==================== ======== ============= ===================================================================

so bf16 Adam gives 18, 6 + 12/d, 2 + 16/d and 16/d bytes per parameter (fp32: 16, 8 + 8/d, 4 + 16/d, 16/d); the
transient all-gather / reduce-scatter buffers of one unit are not counted (megatron.core.distributed.memory measures
the same three classes on a built model).

Multi-latent attention (``--multi-latent-attention``) replaces the standard attention's projections by its down / up
projections and latent norms; ``--mtp-num-layers`` adds the multi-token-prediction depths (and an embedding) to
the last stage. MoE layers (``--num-experts``, ``--moe-layer-freq``) replace the dense MLP by the router (``E x h``), this rank's
``E / EP`` experts (each split by expert TP) and the shared experts; with the distributed optimizer the expert
state is sharded over the expert data-parallel group. Activations are counted as for the dense MLP.
Parameter counts follow this library's GPT/BERT layers exactly (biases, LayerNorm/RMSNorm, GQA, SwiGLU, tied or
untied output layer, learned position embeddings), so weights, gradients and optimizer state can be compared
with what a built model and optimizer hold (megatron.core.distributed.memory; tests/training/
test_train_theoretical_memory.py, --fake-process-group's rank report).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

MB = 1024.0 * 1024.0
GB = 1024.0 * MB

_PARAM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _precision(args) -> str:
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp32"


def _norm_params(args, size: int) -> int:
    return 2 * size if getattr(args, "normalization", "LayerNorm") == "LayerNorm" else size


def _attention_params(args, tp: int) -> int:
    """One layer's self-attention on one tensor-parallel rank (its input norm excluded).

    Standard attention: QKV (column-parallel, optional bias) and the output projection (row-parallel, replicated
    bias). Multi-latent attention (``--multi-latent-attention``, ``n`` heads, ``d_n``/``d_r``/``d_v`` the
    ``--qk-head-dim``/``--qk-pos-emb-head-dim``/``--v-head-dim``): the down projections ``h x q_lora`` and
    ``h x (kv_lora + d_r)`` replicated on every TP rank, the up projections ``q_lora x n (d_n + d_r) / t`` and
    ``kv_lora x n (d_n + d_v) / t``, the latent norms with ``--qk-layernorm``, the output ``n d_v / t x h``; without
    ``--q-lora-rank`` one ``h x n (d_n + d_r) / t`` query projection."""
    h, heads = args.hidden_size, args.num_attention_heads
    bias = getattr(args, "add_bias_linear", True)
    if getattr(args, "multi_latent_attention", False):
        d_n, d_r, d_v = args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim
        q_lora, kv_lora, norm = args.q_lora_rank, args.kv_lora_rank, getattr(args, "qk_layernorm", False)
        params = h * (kv_lora + d_r) + kv_lora * heads * (d_n + d_v) // tp
        params += _norm_params(args, kv_lora) if norm else 0
        if q_lora is None:
            params += h * heads * (d_n + d_r) // tp
        else:
            params += h * q_lora + q_lora * heads * (d_n + d_r) // tp + (_norm_params(args, q_lora) if norm else 0)
        return params + heads * d_v // tp * h + h * bias
    kv_channels = args.kv_channels or h // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    q_size, kv_size = kv_channels * heads, kv_channels * groups
    qkv_bias = bias or getattr(args, "add_qkv_bias", False)
    params = h * (q_size + 2 * kv_size) // tp + (q_size + 2 * kv_size) // tp * qkv_bias  # QKV (column)
    return params + q_size // tp * h + h * bias  # output projection (row; its bias is replicated)


def _layer_params(args, tp: int) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank (dense MLP)."""
    norms = 2 * _norm_params(args, args.hidden_size)  # input and pre-MLP norms (replicated on every TP rank)
    return norms + _attention_params(args, tp) + _dense_mlp_params(args, tp)


def _mtp_params(args, tp: int) -> int:
    """``--mtp-num-layers`` depths on the last stage: each has two input norms, ``eh_proj`` (``2h x h / t``), a
    transformer layer of the decoder's last layer type and a final norm."""
    depths = getattr(args, "mtp_num_layers", None) or 0
    if not depths:
        return 0
    h = args.hidden_size
    layer = _layer_params(args, tp)
    if _is_moe_layer(args, args.num_layers - 1):
        layer += sum(_moe_mlp_params(args, tp)) - _dense_mlp_params(args, tp)
    return depths * (3 * _norm_params(args, h) + 2 * h * h // tp + layer)


def _is_moe_layer(args, layer: int) -> bool:
    """Layer ``layer`` (0-based) has an MoE MLP (``--num-experts`` with ``--moe-layer-freq``)."""
    if not getattr(args, "num_experts", None):
        return False
    freq = getattr(args, "moe_layer_freq", 1)
    return layer % freq == 0 if isinstance(freq, int) else bool(freq[layer])


def _moe_mlp_params(args, tp: int):
    """(dense part, expert part) of an MoE layer's MLP on one rank, replacing the dense MLP of ``_layer_params``:
    the router ``E x h`` (replicated), the rank's ``E / EP`` experts split by expert TP, and the shared experts
    (tensor-parallel like a dense MLP)."""
    h, experts = args.hidden_size, args.num_experts
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    bias = getattr(args, "add_bias_linear", True)
    ffn = getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size or 4 * h
    glu = 2 if getattr(args, "swiglu", False) else 1
    router = experts * h + experts * bias
    per_expert = h * glu * ffn // etp + ffn // etp * h + (glu * ffn + h) * bias
    shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
    shared_params = h * glu * shared // tp + shared // tp * h + (h if getattr(args, "moe_shared_expert_gate", False)
                                                                  else 0)
    return router + shared_params, experts // ep * per_expert


def _dense_mlp_params(args, tp: int) -> int:
    h, bias = args.hidden_size, getattr(args, "add_bias_linear", True)
    ffn = args.ffn_hidden_size or 4 * h
    fc1_out = 2 * ffn if getattr(args, "swiglu", False) else ffn
    return h * fc1_out // tp + fc1_out // tp * bias + ffn // tp * h + h * bias


def stage_expert_params(args, stage: int) -> int:
    """Expert parameters on one rank of pipeline stage ``stage`` (sharded over expert DP by the distributed
    optimizer, not over DP); the last stage's multi-token-prediction layers included."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    per_stage = args.num_layers // pp
    layers = list(range(stage * per_stage, (stage + 1) * per_stage))
    if stage == pp - 1 and _is_moe_layer(args, args.num_layers - 1):
        layers += [args.num_layers - 1] * (getattr(args, "mtp_num_layers", None) or 0)
    return sum(_moe_mlp_params(args, tp)[1] for layer in layers if _is_moe_layer(args, layer))


def _padded_vocab(args) -> int:
    vocab = getattr(args, "padded_vocab_size", None)
    if not vocab:
        raise ValueError("padded_vocab_size is unknown: pass --vocab-size, or --vocab-file (and --merge-file) so "
                         "that the tokenizer's vocabulary can be read")
    return vocab


def stage_params(args, stage: int) -> int:
    """Parameters on one (TP rank, pipeline stage ``stage``) for the model of ``args.model_name`` (gpt/bert)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    h = args.hidden_size
    is_bert = getattr(args, "model_name", "gpt") == "bert"
    vocab = _padded_vocab(args) // tp
    first, last = stage == 0, stage == pp - 1
    norm = 2 * h if getattr(args, "normalization", "LayerNorm") == "LayerNorm" else h
    untied = getattr(args, "untie_embeddings_and_output_weights", False)

    layers_here = args.num_layers // pp
    params = layers_here * _layer_params(args, tp)
    for layer in range(stage * layers_here, (stage + 1) * layers_here):
        if _is_moe_layer(args, layer):  # an MoE MLP instead of the dense one
            params += sum(_moe_mlp_params(args, tp)) - _dense_mlp_params(args, tp)
    mtp = bool(getattr(args, "mtp_num_layers", None)) and last
    if first or mtp:  # the multi-token-prediction stage holds an embedding too
        params += vocab * h
        if getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute" and \
                getattr(args, "add_position_embedding", True):
            params += args.max_position_embeddings * h
    if mtp:
        params += _mtp_params(args, tp)
        if is_bert and getattr(args, "bert_binary_head", True):
            params += 2 * h  # token-type embeddings
    if last:
        params += norm  # final norm
        if untied or (pp > 1 and not is_bert and not mtp):
            params += vocab * h  # untied output layer, or the last stage's copy of the tied embedding (the MTP
            # stage's embedding serves as it)
        if is_bert:
            if pp > 1:
                params += vocab * h  # tied word-embedding copy for the LM head
            params += h * h + h + norm + vocab  # LM head dense, its norm and the vocab-parallel output bias
            if getattr(args, "bert_binary_head", True):
                params += h * h + h + 2 * h + 2  # pooler and binary (sentence-order) head
    return params


@dataclass
class MemoryReport:
    """Bytes per rank, for each pipeline stage (index 0 = first stage)."""
    precision: str
    data_parallel_size: int
    distributed_optimizer: bool
    recompute: str
    params: List[int]
    weights: List[float]
    grads: List[float]
    optimizer: List[float]
    activations: List[float]
    bytes_per_param: Dict[str, float] = field(default_factory=dict)
    sharding: str = "no_shard"

    def total(self, stage: int) -> float:
        return self.weights[stage] + self.grads[stage] + self.optimizer[stage] + self.activations[stage]

    def table(self) -> str:
        rows = ["stage  parameters   weights (MB)  grads (MB)  optimizer (MB)  activations (MB)  total (MB)"]
        for s in range(len(self.params)):
            rows.append("{:5d}  {:10d}  {:13.1f}  {:10.1f}  {:14.1f}  {:16.1f}  {:10.1f}".format(
                s, self.params[s], self.weights[s] / MB, self.grads[s] / MB, self.optimizer[s] / MB,
                self.activations[s] / MB, self.total(s) / MB))
        return "\n".join(rows)


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def sharding_strategy(args) -> str:
    """What the run shards over data parallelism, in Megatron-FSDP's terms: ``--use-torch-fsdp2`` is
    ``optim_grads_params``, ``--use-megatron-fsdp`` its ``--data-parallel-sharding-strategy``, otherwise ``optim``
    with ``--use-distributed-optimizer`` and ``no_shard`` without."""
    if getattr(args, "use_torch_fsdp2", False):
        return "optim_grads_params"
    if getattr(args, "use_megatron_fsdp", False):
        return args.data_parallel_sharding_strategy
    return "optim" if getattr(args, "use_distributed_optimizer", False) else "no_shard"


def _fsdp2_bytes(args, sharding: str, d: int) -> Dict[str, float]:
    """ZeRO-2 / ZeRO-3 on FSDP2 (module docstring): the sharded fp32 parameter is the main weight."""
    moments = 8 if args.optimizer == "adam" else (4 if getattr(args, "sgd_momentum", 0.0) else 0)
    weights = float(_PARAM_BYTES[_precision(args)]) if sharding == "optim_grads" else 0.0
    return {"weights": weights, "grads": 4.0 / d, "optimizer": (4.0 + moments) / d}


def bytes_per_parameter(args, distributed_optimizer: bool, sharding: str = None, d: int = None) -> Dict[str, float]:
    """(weights, grads, optimizer) bytes per parameter on one rank; ``sharding`` (a Megatron-FSDP strategy)
    overrides ``distributed_optimizer``; ``d``: the sharding group's size (default: the data-parallel size, x the
    context-parallel size for the FSDP2 strategies)."""
    if sharding in ("optim_grads", "optim_grads_params"):
        dp_cp = args.data_parallel_size * (getattr(args, "context_parallel_size", 1) or 1)
        return _fsdp2_bytes(args, sharding, d or dp_cp)
    if sharding is not None:
        distributed_optimizer = sharding == "optim"
    precision = _precision(args)
    param_bytes = _PARAM_BYTES[precision]
    grad_fp32 = precision == "bf16" or getattr(args, "accumulate_allreduce_grads_in_fp32", False) or precision == "fp32"
    grad_bytes = 4 if grad_fp32 else param_bytes
    optimizer_bytes = 8 if args.optimizer == "adam" else (4 if getattr(args, "sgd_momentum", 0.0) else 0)
    if precision != "fp32":
        optimizer_bytes += 4  # fp32 main parameters
        if not grad_fp32:
            optimizer_bytes += 4  # fp32 copies of the 16-bit gradients
    if distributed_optimizer:
        optimizer_bytes /= d or args.data_parallel_size
    return {"weights": float(param_bytes), "grads": float(grad_bytes), "optimizer": float(optimizer_bytes)}


def activation_bytes(args, stage: int, recompute: str) -> float:
    """Activation memory on one rank of pipeline stage ``stage`` (``recompute``: none, selective, full)."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    a, tp, pp = args.num_attention_heads, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    sp = getattr(args, "sequence_parallel", False)
    element = 4 if _precision(args) == "fp32" else 2
    ffn_ratio = (args.ffn_hidden_size or 4 * h) / h
    # Per layer, in elements: LN inputs 2 sbh, QKV input sbh, Q and K 2 sbh, V sbh, projection input sbh,
    # MLP input sbh, fc1 output and GeLU output 2 ffn/h sbh (4 sbh each for ffn = 4h) -> 16 sbh for ffn = 4h;
    # at 2 bytes plus the two 1-byte masks that is the paper's 34 sbh.
    # dropout masks (1 byte): attention output and MLP output 2 sbh. Attention scores: softmax output and its
    # dropout output 2 a s^2 b elements plus the dropout mask a s^2 b bytes.
    replicated = (2 + 1 + 1) * s * b * h * element + 2 * s * b * h  # not split by TP unless SP
    split = (2 + 1 + 1 + 2 * ffn_ratio) * s * b * h * element  # Q K, V, projection input, fc1 + GeLU: split by TP
    scores = (2 * element + 1) * a * s * s * b  # split by TP
    if recompute == "full":
        per_layer = s * b * h * element / (tp if sp else 1)
    else:
        per_layer = (replicated / (tp if sp else 1)) + split / tp
        if recompute != "selective":
            per_layer += scores / tp
    layers_here = args.num_layers // pp
    num_microbatches = max(args.global_batch_size // (b * args.data_parallel_size), 1)
    in_flight = min(pp - stage, num_microbatches)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp and stage == 0:
        in_flight *= 1 + (pp - 1) / (pp * vpp)
    total = per_layer * layers_here * in_flight
    if stage == 0:
        total += s * b * h * (element + 1) / (tp if sp else 1) * in_flight  # embedding output + dropout mask
    if stage == pp - 1:
        total += 4 * s * b * _padded_vocab(args) / tp  # fp32 logits for the cross entropy
    return total


def recompute_mode(args) -> str:
    if getattr(args, "recompute_granularity", None) == "full":
        return "full"
    if getattr(args, "recompute_granularity", None) == "selective":
        return "selective"
    return "none"


def report_theoretical_memory(args, distributed_optimizer=None, recompute=None, sharding=None) -> MemoryReport:
    """Memory per rank for ``args``; ``distributed_optimizer`` / ``recompute`` / ``sharding`` (a Megatron-FSDP
    strategy, module docstring) override the flags (what-if)."""
    if sharding is None:
        sharding = sharding_strategy(args) if distributed_optimizer is None else \
            ("optim" if distributed_optimizer else "no_shard")
    recompute = recompute or recompute_mode(args)
    per_param = bytes_per_parameter(args, False, sharding)
    pp = args.pipeline_model_parallel_size
    params = [stage_params(args, s) for s in range(pp)]
    totals = {kind: [n * per_param[kind] for n in params] for kind in ("weights", "grads", "optimizer")}
    if sharding != "no_shard" and getattr(args, "num_experts", None):
        # Expert state is sharded over the expert data-parallel group (EDP = world / (ETP x EP x PP)).
        world = args.data_parallel_size * args.tensor_model_parallel_size * pp * \
            (getattr(args, "context_parallel_size", 1) or 1)
        edp = world // ((getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size)
                        * (getattr(args, "expert_model_parallel_size", 1) or 1) * pp)
        expert = bytes_per_parameter(args, False, sharding, d=max(edp, 1))
        for kind in totals:
            totals[kind] = [(n - e) * per_param[kind] + e * expert[kind]
                            for n, e in zip(params, [stage_expert_params(args, s) for s in range(pp)])]
    return MemoryReport(
        precision=_precision(args), data_parallel_size=args.data_parallel_size,
        distributed_optimizer=sharding == "optim", recompute=recompute, params=params,
        weights=totals["weights"], grads=totals["grads"], optimizer=totals["optimizer"],
        activations=[activation_bytes(args, s, recompute) for s in range(pp)], bytes_per_param=per_param,
        sharding=sharding)
