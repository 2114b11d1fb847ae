"""``validate_args``'s step for multi-latent attention, YaRN and multi-token prediction (Megatron-LM HEAD's rules).

* ``--multi-latent-attention``: megatron-core models only; no grouped-query attention (one latent serves every head);
  ``--rope-type`` (yarn if not given) picks its rotary embedding, which it owns: ``--position-embedding-type rope``
  builds no model-level rotary embedding (``--cache-mla-latents`` and ``--mla-down-proj-fusion`` are refused by the
  option registry).
* ``--rope-type yarn`` without multi-latent attention is refused (use ``--position-embedding-type yarn``).
* ``--mtp-num-layers N``: megatron-core models, ``--position-embedding-type rope`` or ``none`` (its other variants are
  refused by the option registry).
"""
from __future__ import annotations

from megatron.training.errors import ConfigurationError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def validate_mla_and_mtp(args) -> None:
    legacy = getattr(args, "use_legacy_models", False)
    if args.multi_latent_attention:
        _require(not legacy, "--multi-latent-attention needs the megatron-core models: drop --use-legacy-models")
        _require(not args.group_query_attention,
                 "--multi-latent-attention shares one key/value latent between all heads: drop "
                 "--group-query-attention")
        _require(args.kv_lora_rank > 0 and args.qk_head_dim > 0 and args.v_head_dim > 0,
                 "--kv-lora-rank, --qk-head-dim and --v-head-dim must be > 0")
        _require(args.qk_pos_emb_head_dim > 0 and args.qk_pos_emb_head_dim % 2 == 0,
                 f"--qk-pos-emb-head-dim must be even and > 0 (rotary pairs), got {args.qk_pos_emb_head_dim}")
        _require(args.q_lora_rank is None or args.q_lora_rank > 0,
                 f"--q-lora-rank must be > 0 (or not given), got {args.q_lora_rank}")
        _require(not (args.rotary_interleaved and args.rope_type != "rope"),
                 "--rotary-interleaved is not supported by multi-latent attention with YaRN (--rope-type yarn)")
    else:
        _require(args.rope_type in (None, "rope"),
                 f"--rope-type {args.rope_type} needs --multi-latent-attention (use --position-embedding-type yarn)")
    _require(args.rotary_scaling_factor > 0, f"--rotary-scaling-factor must be > 0, got {args.rotary_scaling_factor}")
    _require(not (args.position_embedding_type == "yarn" and args.rotary_interleaved),
             "--position-embedding-type yarn does not support --rotary-interleaved")
    if args.position_embedding_type == "yarn":
        _require(not legacy, "--position-embedding-type yarn needs the megatron-core models: drop --use-legacy-models")
    mtp = args.mtp_num_layers
    if mtp is not None:
        _require(mtp >= 0, f"--mtp-num-layers must be >= 0, got {mtp}")
    if mtp:
        _require(not legacy, "--mtp-num-layers needs the megatron-core models: drop --use-legacy-models")
        _require(args.position_embedding_type in ("rope", "none"),
                 f"--mtp-num-layers needs --position-embedding-type rope or none, got {args.position_embedding_type}")
