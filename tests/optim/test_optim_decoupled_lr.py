"""--decoupled-lr / --decoupled-min-lr: the embedding and output weights follow their own LR schedule.

A toy model with two parameters marked ``is_embedding_or_output_parameter`` (as the megatron-core language
models mark ``embedding.word_embeddings.weight`` and ``output_layer.weight``). lr 1e-3, min-lr 1e-4,
decoupled lr 5e-3, decoupled min lr 5e-4, warmup W = 2 steps from 0, decay D = 10 steps; the tables below are
worked out by hand from Megatron's formulas (warmup: max_lr * n / W; linear: min + (1 - r) (max - min);
cosine: min + (1 + cos(pi r)) / 2 (max - min); r = (n - W) / (D - W); n > D: min).
"""
import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)
        self.hidden = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.output_layer = torch.nn.Linear(4, 10, bias=False)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.output_layer.weight.is_embedding_or_output_parameter = True


# (steps n, default-group lr, decoupled-group lr)
TABLES = {
    "linear": [(0, 0.0, 0.0), (1, 5e-4, 2.5e-3), (2, 1e-3, 5e-3),
               (4, 7.75e-4, 3.875e-3),   # r = 2/8: 1e-4 + 0.75 * 9e-4 ; 5e-4 + 0.75 * 4.5e-3
               (6, 5.5e-4, 2.75e-3),     # r = 1/2
               (10, 1e-4, 5e-4), (12, 1e-4, 5e-4)],
    "cosine": [(1, 5e-4, 2.5e-3), (2, 1e-3, 5e-3),
               (4, 1e-4 + 9e-4 * (1 + 2 ** -0.5) / 2, 5e-4 + 4.5e-3 * (1 + 2 ** -0.5) / 2),  # cos(pi/4)
               (6, 5.5e-4, 2.75e-3),     # cos(pi/2) = 0
               (10, 1e-4, 5e-4), (11, 1e-4, 5e-4)],
}


def _optimizer(decoupled_min_lr=5e-4):
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-3, decoupled_min_lr=decoupled_min_lr,
                             weight_decay=0.1)
    return get_megatron_optimizer(config, [Toy()])


def test_param_groups_split_embedding_and_output():
    model = Toy()
    groups = get_param_groups([model], decoupled_lr=5e-3, decoupled_min_lr=5e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    decoupled = [names[id(p)] for g in groups if g.get("is_decoupled_lr") for p in g["params"]]
    assert sorted(decoupled) == ["embedding.weight", "output_layer.weight"]
    for g in groups:
        if g.get("is_decoupled_lr"):
            assert g["max_lr"] == 5e-3 and g["min_lr"] == 5e-4 and g["wd_mult"] == 1.0
        else:
            assert "max_lr" not in g
    # Without --decoupled-lr nothing is split off (and the groups are the 2023 ones).
    plain = get_param_groups([model])
    assert not any(g.get("is_decoupled_lr") for g in plain) and len(plain) == 2


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decoupled_lr_table(style):
    optimizer = _optimizer()
    sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="constant")
    for n, default_lr, decoupled_lr in TABLES[style]:
        sched.num_steps = 0
        sched.step(n)
        for group in optimizer.param_groups:
            expected = decoupled_lr if group.get("is_decoupled_lr") else default_lr
            assert group["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15), (style, n, group.get("is_decoupled_lr"))


def test_decoupled_min_lr_defaults_to_min_lr():
    optimizer = _optimizer(decoupled_min_lr=None)
    sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="constant")
    sched.step(6)  # r = 1/2: 1e-4 + 0.5 * (5e-3 - 1e-4)
    lrs = {bool(g.get("is_decoupled_lr")): g["lr"] for g in optimizer.param_groups}
    assert lrs[True] == pytest.approx(2.55e-3, rel=1e-12) and lrs[False] == pytest.approx(5.5e-4, rel=1e-12)
    sched.step(10)
    assert all(g["lr"] == pytest.approx(1e-4) for g in optimizer.param_groups)


def test_state_dict_round_trip_keeps_decoupled_groups():
    optimizer = _optimizer()
    state = optimizer.state_dict()
    # A checkpoint from before --decoupled-lr (no max_lr / min_lr in its groups) keeps this run's values.
    for group in state["param_groups"]:
        for key in ("is_decoupled_lr", "max_lr", "min_lr"):
            group.pop(key, None)
    fresh = _optimizer()
    fresh.load_state_dict(state)
    decoupled = [g for g in fresh.param_groups if g.get("is_decoupled_lr")]
    assert decoupled and all(g["max_lr"] == 5e-3 and g["min_lr"] == 5e-4 for g in decoupled)
