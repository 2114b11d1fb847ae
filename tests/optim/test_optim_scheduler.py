"""OptimizerParamScheduler against values worked out by hand from Megatron's formulas.

Common setting: init_lr 0.0, max_lr 1.0, min_lr 0.1, warmup W = 10 steps, decay D = 110 steps, so
warmup gives lr = n / 10 and the decay ratio is r = (n - 10) / 100, lr = 0.1 + c * 0.9.
"""
import pytest

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 0.5, "wd_mult": 0.0}, {}]


def make(style="linear", wd_style="constant", start_wd=0.05, end_wd=0.05, **kw):
    args = dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=10, lr_decay_steps=110,
                lr_decay_style=style, start_wd=start_wd, end_wd=end_wd, wd_incr_steps=100, wd_incr_style=wd_style)
    args.update(kw)
    return OptimizerParamScheduler(FakeOptimizer(), **args)


def lr_at(sched, n):
    sched.num_steps = 0
    sched.step(n)
    return sched.get_lr()


LR_TABLES = {
    "linear": [
        (0, 0.0),      # warmup: 0 + (1 - 0) * 0/10
        (5, 0.5),      # warmup: 5/10
        (10, 1.0),     # n <= W still warmup: 10/10
        (35, 0.775),   # r = 25/100 = 0.25, c = 0.75, 0.1 + 0.75 * 0.9
        (60, 0.55),    # r = 0.5, 0.1 + 0.5 * 0.9
        (110, 0.1),    # r = 1, c = 0
        (200, 0.1),    # n > D: min_lr
    ],
    "cosine": [
        (5, 0.5),                   # warmup
        (35, 0.8681980515339464),   # c = (cos(pi/4) + 1)/2 = 0.8535533905932737; 0.1 + 0.9c
        (60, 0.55),                 # c = (cos(pi/2) + 1)/2 = 0.5
        (85, 0.23180194846605365),  # c = (cos(3pi/4) + 1)/2 = 0.14644660940672627; 0.1 + 0.9c
        (110, 0.1),                 # c = (cos(pi) + 1)/2 = 0
        (111, 0.1),                 # n > D
    ],
    "constant": [
        (5, 0.5),    # warmup applies to every style
        (60, 1.0),   # max_lr
        (200, 1.0),  # constant ignores the decay length
    ],
    "inverse-square-root": [
        (5, 0.5),                   # warmup
        (10, 1.0),                  # warmup end
        (40, 0.5),                  # 1 * sqrt(10) / sqrt(40) = sqrt(1/4)
        (90, 0.3333333333333333),   # sqrt(10/90) = 1/3
        (110, 0.30151134457776363),  # sqrt(10/110)
        (111, 0.1),                 # n > D: min_lr
    ],
}

# WSD: stable at max_lr until D - 20 = 90, then anneal over 20 steps; at n = 95 the ratio is 5/20 = 0.25.
WSD_TABLES = {
    "linear": [(60, 1.0), (90, 1.0), (95, 0.775), (110, 0.1)],  # c = 1 - 0.25
    "cosine": [(95, 0.8681980515339464), (110, 0.1)],  # c = (cos(0.25 pi) + 1)/2
    "exponential": [(95, 0.7136135474566861), (110, 0.1)],  # c = 2 * 0.5**0.25 - 1 = 0.6817928305074290
    "minus_sqrt": [(95, 0.55), (110, 0.1)],  # c = 1 - sqrt(0.25) = 0.5
}

WD_TABLES = {
    # start 0.0, end 0.1, I = 100 steps, r = n / 100
    "linear": [(0, 0.0), (25, 0.025), (50, 0.05), (100, 0.1), (150, 0.1)],  # 0.1 * r; n > I: end
    "cosine": [
        (0, 0.0),                    # c = (cos(pi * (1 - 0)) + 1)/2 = 0
        (25, 0.014644660940672627),  # c = (cos(0.75 pi) + 1)/2 = 0.14644660940672627
        (50, 0.05),                  # c = 0.5
        (75, 0.08535533905932738),   # c = (cos(0.25 pi) + 1)/2
        (100, 0.1),
    ],
}


@pytest.mark.parametrize("style", sorted(LR_TABLES))
def test_lr_decay_styles(style):
    sched = make(style)
    for n, expected in LR_TABLES[style]:
        assert lr_at(sched, n) == pytest.approx(expected, rel=1e-12, abs=1e-15), (style, n)


@pytest.mark.parametrize("wsd_style", sorted(WSD_TABLES))
def test_wsd(wsd_style):
    sched = make("WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    for n, expected in WSD_TABLES[wsd_style]:
        assert lr_at(sched, n) == pytest.approx(expected, rel=1e-12), (wsd_style, n)


def test_inverse_square_root_is_floored_at_min_lr():
    sched = make("inverse-square-root", min_lr=0.4)
    assert lr_at(sched, 90) == 0.4  # max(0.4, 1/3)


@pytest.mark.parametrize("wd_style", sorted(WD_TABLES))
def test_weight_decay_increment_styles(wd_style):
    sched = make("linear", wd_style=wd_style, start_wd=0.0, end_wd=0.1)
    for n, expected in WD_TABLES[wd_style]:
        sched.num_steps = 0
        sched.step(n)
        assert sched.get_wd() == pytest.approx(expected, rel=1e-12, abs=1e-15), (wd_style, n)
    constant = make("linear", wd_style="constant", start_wd=0.05, end_wd=0.05)
    for n in (0, 50, 500):
        constant.num_steps = 0
        constant.step(n)
        assert constant.get_wd() == 0.05


def test_param_groups_get_lr_and_wd_multipliers():
    sched = make("linear", wd_style="linear", start_wd=0.0, end_wd=0.1)
    sched.step(35)  # lr 0.775, wd 0.1 * 35/100 = 0.035
    g0, g1, g2 = sched.optimizer.param_groups
    assert g0["lr"] == pytest.approx(0.775) and g0["weight_decay"] == pytest.approx(0.035)
    assert g1["lr"] == pytest.approx(0.3875) and g1["weight_decay"] == 0.0  # lr_mult 0.5, wd_mult 0
    assert g2["lr"] == pytest.approx(0.775) and g2["weight_decay"] == pytest.approx(0.035)  # defaults 1.0


MEGATRON_KEYS = ["end_wd", "lr_decay_steps", "lr_decay_style", "lr_warmup_steps", "max_lr", "min_lr", "num_steps",
                 "start_wd", "wd_incr_steps", "wd_incr_style"]


def test_state_dict_round_trip_and_checkpoint_rules():
    a = make("cosine", use_checkpoint_opt_param_scheduler=False)
    a.step(60)
    sd = a.state_dict()
    assert sorted(sd) == MEGATRON_KEYS
    assert sd["num_steps"] == 60 and sd["max_lr"] == 1.0 and sd["lr_decay_style"] == "cosine"

    b = make("cosine", use_checkpoint_opt_param_scheduler=False)
    b.step(7)  # loading sets the step count, it does not add to it
    b.load_state_dict(sd)
    assert b.num_steps == 60 and b.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)

    # A mismatch is an error naming the value unless one of the two flags says which side wins.
    with pytest.raises(ValueError, match="learning rate.*--override-opt_param-scheduler"):
        make("cosine", max_lr=2.0, use_checkpoint_opt_param_scheduler=False).load_state_dict(sd)
    with pytest.raises(ValueError, match="decay style"):
        make("linear", use_checkpoint_opt_param_scheduler=False).load_state_dict(sd)

    use_ckpt = make("linear", max_lr=2.0, use_checkpoint_opt_param_scheduler=True)
    use_ckpt.load_state_dict(sd)
    assert use_ckpt.max_lr == 1.0 and use_ckpt.lr_decay_style == "cosine" and use_ckpt.get_lr() == pytest.approx(0.55)

    override = make("linear", max_lr=2.0, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    override.load_state_dict(sd)
    # Own settings, checkpoint's step count: linear, r = 0.5 -> 0.1 + 0.5 * (2.0 - 0.1) = 1.05
    assert override.max_lr == 2.0 and override.num_steps == 60 and override.get_lr() == pytest.approx(1.05)

    with pytest.raises(ValueError, match="both"):
        make(use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True)

    # Older checkpoints' key names.
    old = {"start_lr": 1.0, "min_lr": 0.1, "warmup_iter": 10, "end_iter": 110, "decay_style": "linear",
           "num_iters": 35}
    legacy = make("linear", use_checkpoint_opt_param_scheduler=False)
    legacy.load_state_dict(old)
    assert legacy.num_steps == 35 and legacy.get_lr() == pytest.approx(0.775)


def test_bad_arguments_name_the_flag():
    with pytest.raises(ValueError, match="--lr-decay-style"):
        make("polynomial")
    with pytest.raises(ValueError, match="warmup"):
        make(lr_warmup_steps=200)
    with pytest.raises(ValueError, match="--min-lr"):
        make(min_lr=2.0)
    with pytest.raises(ValueError, match="--weight-decay-incr-style"):
        make(wd_style="exp")
    with pytest.raises(ValueError, match="WSD"):
        make("WSD")
