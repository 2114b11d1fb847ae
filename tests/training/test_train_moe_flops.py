"""The FLOPs formula with MoE layers counts the active experts (k routed experts of width moe_ffn + the shared
experts per MoE layer) as Megatron does, checked against a hand count of the GEMMs of one forward pass x 3."""
import argparse

from megatron.training.training_log import num_floating_point_operations


def _hand_flops(B, s, L, h, V, dense_ffn, moe_layers, k, moe_ffn, shared):
    """2 FLOPs per MAC, x3 for forward + backward: QKV + projection 4 h^2 (MHA), attention 2 s h, per dense MLP
    3 h ffn (swiglu: two input projections and one output), per MoE MLP 3 h (k moe_ffn + shared), logits h V."""
    per_token = 0
    for layer in range(L):
        per_token += 4 * h * h + 2 * s * h
        per_token += 3 * h * (k * moe_ffn + shared) if layer in moe_layers else 3 * h * dense_ffn
    per_token += h * V
    return 3 * 2 * B * s * per_token


def test_moe_flops_count_active_experts():
    args = argparse.Namespace(swiglu=True, group_query_attention=False, num_attention_heads=4, hidden_size=64,
                              seq_length=32, num_layers=4, ffn_hidden_size=128, padded_vocab_size=1024,
                              num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96, moe_layer_freq=2,
                              moe_shared_expert_intermediate_size=32)
    ours = num_floating_point_operations(args, batch_size=3)
    hand = _hand_flops(3, 32, 4, 64, 1024, 128, {0, 2}, 2, 96, 32)
    assert abs(ours - hand) <= 1e-9 * hand, (ours, hand)
    dense = argparse.Namespace(**{**vars(args), "num_experts": None})
    assert abs(num_floating_point_operations(dense, 3) - _hand_flops(3, 32, 4, 64, 1024, 128, set(), 0, 0, 0)) \
        <= 1e-9 * ours
