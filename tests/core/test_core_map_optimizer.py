"""megatron-core 0.16.1's optimizer names (issue 29's module map): config overrides (ParamKey, ParamGroupOverride and
their helpers), Range, BufferType / partition_buckets, qk_clip, ChainedOptimizer / ProxyDict, Muon.

The override machinery is compared with the real megatron-core (the oracle) run in a subprocess on the same model
description: its ``optimizer_config`` and ``optimizer_param_scheduler`` modules are loaded as they are, and its
``get_standard_config_overrides`` / ``check_config_overrides_consistency`` / ``_get_param_groups`` are taken from
its ``optimizer/__init__.py`` without importing the rest of megatron-core (which takes seconds). The Muon math is
checked against an SVD (``U V^T``) and a plain PyTorch restatement of the update.
"""
import json
import math

import pytest
import torch

from helpers.mcore_oracle import run_oracle
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)

# (name, shape, attributes): a decoder layer with q/k layernorms, an embedding (decoupled lr) and an expert weight.
PARAMS = [
    ("embedding.word_embeddings.weight", (16, 8), {"is_embedding_or_output_parameter": True}),
    ("decoder.layers.0.self_attention.linear_qkv.weight", (24, 8), {}),
    ("decoder.layers.0.self_attention.linear_qkv.bias", (24,), {}),
    ("decoder.layers.0.self_attention.q_layernorm.weight", (4,), {}),
    ("decoder.layers.0.self_attention.k_layernorm.weight", (4,), {}),
    ("decoder.layers.0.input_layernorm.weight", (8,), {}),
    ("decoder.layers.0.mlp.experts.weight1", (8, 16), {"allreduce": False}),
    ("decoder.layers.0.mlp.linear_fc1.weight", (16, 8), {}),
    ("output_layer.weight", (16, 8), {"is_embedding_or_output_parameter": True}),
]
CONFIGS = {
    "standard": dict(lr=1e-3, min_lr=1e-5),
    "qk_ln_wd": dict(lr=1e-3, min_lr=1e-5, apply_wd_to_qk_layernorm=True),
    "decoupled": dict(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-3, decoupled_min_lr=5e-4),
    "decoupled_no_min": dict(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-3),
}
# User overrides, each (ParamKey fields, override): names by pattern, attribute, several keys on one parameter.
USER_OVERRIDES = [
    ({"name": "*.linear_fc1.weight"}, {"lr_mult": 0.5, "wd_mult": 0.1}),
    ({"name": ("*experts*", "*q_layernorm*")}, {"max_lr": 2e-3}),
    ({"attr": "is_embedding_or_output_parameter"}, {"min_lr": 0.0}),
]

BUILD = r"""
import torch
def build(params):
    root = torch.nn.Module()
    for i, (name, shape, attrs) in enumerate(params):
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        p = torch.nn.Parameter(torch.full(tuple(shape), float(i)))
        for k, v in attrs.items():
            setattr(p, k, v)
        module.register_parameter(leaf, p)
    return root
def describe(groups, model):
    names = {p: n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
            for g in groups]
"""

ORACLE = BUILD + r"""
import ast, json, os, sys, types
import megatron
oracle = list(megatron.__path__)[0]
# Load megatron.core's optimizer_config / optimizer_param_scheduler without megatron/core/__init__.py.
core = types.ModuleType("megatron.core"); core.__path__ = [os.path.join(oracle, "core")]
opt = types.ModuleType("megatron.core.optimizer"); opt.__path__ = [os.path.join(oracle, "core", "optimizer")]
utils = types.ModuleType("megatron.core.utils")
utils.is_te_min_version = lambda *a, **k: False
utils.log_single_rank = lambda *a, **k: None
sys.modules.update({"megatron.core": core, "megatron.core.optimizer": opt, "megatron.core.utils": utils})
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey, ParamPredicate, ParamWithNamePredicate
from megatron.core.optimizer_param_scheduler import (ParamGroupOverride, combine_param_group_overrides,
    get_canonical_lr_for_logging, param_group_override_to_tuple)
source = open(os.path.join(oracle, "core", "optimizer", "__init__.py")).read()
wanted = {"get_standard_config_overrides", "check_config_overrides_consistency", "_get_param_groups"}
tree = ast.parse(source)
tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
ns = dict(globals()); ns.update(Dict=dict, List=list, Optional=type(None), Any=object, MegatronModule=object)
import typing; ns.update({k: getattr(typing, k) for k in ("Dict", "List", "Optional", "Any", "Tuple")})
exec(compile(tree, "oracle_optimizer_init", "exec"), ns)
# One rank: _get_param_groups' rank alignment gathers this rank's keys only.
torch.distributed.get_world_size = lambda group=None: 1
torch.distributed.all_gather_object = lambda out, obj, group=None: out.__setitem__(0, obj)
case = json.loads(open(sys.argv[1]).read())
out = {"groups": {}, "user": None}
model = build(case["params"])
for key, kw in case["configs"].items():
    cfg = OptimizerConfig(**kw)
    out["groups"][key] = describe(ns["_get_param_groups"]([model], cfg, None), model)
user = {ParamKey(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}): ParamGroupOverride(**o)
        for fields, o in case["user"]}
cfg = OptimizerConfig(**case["configs"]["standard"])
ns["check_config_overrides_consistency"](cfg, user)
out["user"] = describe(ns["_get_param_groups"]([model], cfg, user), model)
out["empty"] = describe(ns["_get_param_groups"]([model], cfg, {}), model)
out["canonical"] = get_canonical_lr_for_logging([{"lr": 1.0}, {"lr": 2.0, "default_config": True}, {"lr": 3.0, "default_config": True}])
out["tuple"] = param_group_override_to_tuple({"wd_mult": 0.0, "max_lr": 1.0, "b": 2})
out["combined"] = combine_param_group_overrides([{"max_lr": 1.0}, None, {"wd_mult": 0.0, "max_lr": 1.0}])
try:
    combine_param_group_overrides([{"max_lr": 1.0}, {"max_lr": 2.0}])
except ValueError as e:
    out["conflict"] = str(e)
try:
    ns["check_config_overrides_consistency"](cfg, {ParamKey(name="*"): {"optimizer": "sgd"}})
except ValueError as e:
    out["inconsistent"] = str(e)
print("RESULT" + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def oracle_out(tmp_path_factory):
    work = tmp_path_factory.mktemp("optim_oracle")
    case = work / "case.json"
    case.write_text(json.dumps({"params": PARAMS, "configs": CONFIGS, "user": USER_OVERRIDES}))
    script = work / "oracle.py"
    script.write_text(ORACLE)
    out = run_oracle([script, case], cwd=work, timeout=120)
    return json.loads(out.split("RESULT", 1)[1])


def _ours():
    namespace = {}
    exec(BUILD, namespace)
    return namespace["build"], namespace["describe"]


def _jsonable(groups):
    return json.loads(json.dumps(groups, default=str))


def test_param_groups_from_overrides_match_megatron_core(oracle_out):
    from megatron.core.optimizer import (OptimizerConfig, ParamKey, _get_param_groups,
                                         check_config_overrides_consistency)
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    build, describe = _ours()
    model = build(PARAMS)
    for key, kw in CONFIGS.items():
        ours = describe(_get_param_groups([model], OptimizerConfig(**kw), None), model)
        assert _jsonable(ours) == oracle_out["groups"][key], key
    # The standard overrides leave weight decay on the q/k layernorms only with apply_wd_to_qk_layernorm.
    qk = [g for g in oracle_out["groups"]["qk_ln_wd"] if "decoder.layers.0.self_attention.q_layernorm.weight"
          in g["params"]][0]
    assert qk["wd_mult"] == 1.0
    user = {ParamKey(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}):
            ParamGroupOverride(**o) for fields, o in USER_OVERRIDES}
    cfg = OptimizerConfig(**CONFIGS["standard"])
    assert check_config_overrides_consistency(cfg, user) is True
    assert _jsonable(describe(_get_param_groups([model], cfg, user), model)) == oracle_out["user"]
    assert _jsonable(describe(_get_param_groups([model], cfg, {}), model)) == oracle_out["empty"]
    with pytest.raises(ValueError) as err:
        check_config_overrides_consistency(cfg, {ParamKey(name="*"): {"optimizer": "sgd"}})
    assert str(err.value) == oracle_out["inconsistent"]


def test_override_helpers_match_megatron_core(oracle_out):
    from megatron.core.optimizer_param_scheduler import (combine_param_group_overrides, get_canonical_lr_for_logging,
                                                         param_group_override_to_tuple)

    groups = [{"lr": 1.0}, {"lr": 2.0, "default_config": True}, {"lr": 3.0, "default_config": True}]
    assert get_canonical_lr_for_logging(groups) == oracle_out["canonical"] == 2.0
    assert get_canonical_lr_for_logging([{"lr": 1.0}]) is None
    assert _jsonable(param_group_override_to_tuple({"wd_mult": 0.0, "max_lr": 1.0, "b": 2})) == oracle_out["tuple"]
    assert param_group_override_to_tuple(None) is None
    combined = combine_param_group_overrides([{"max_lr": 1.0}, None, {"wd_mult": 0.0, "max_lr": 1.0}])
    assert combined == oracle_out["combined"]
    with pytest.raises(ValueError) as err:
        combine_param_group_overrides([{"max_lr": 1.0}, {"max_lr": 2.0}])
    assert str(err.value) == oracle_out["conflict"]


def test_param_key_predicates_hash_by_name():
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate, ParamWithNamePredicate

    one_d = ParamPredicate(name="s1", fn=lambda p: p.dim() == 1)
    assert one_d == ParamPredicate(name="s1", fn=lambda p: False) and len({one_d, ParamPredicate("s1", None)}) == 1
    assert one_d(torch.empty(3)) and not one_d(torch.empty(2, 2))
    named = ParamWithNamePredicate(name="bias", fn=lambda p, n: n.endswith(".bias"))
    key = ParamKey(predicate=(one_d,), with_name_predicate=named)
    assert key.matches(torch.empty(2, 2), "a.bias") and key.matches(torch.empty(2), "a.w")
    assert not key.matches(torch.empty(2, 2), "a.w") and not ParamKey().matches(torch.empty(2), "x")
    assert {key: 1}[ParamKey(predicate=(ParamPredicate("s1", None),), with_name_predicate=named)] == 1


def test_get_megatron_optimizer_with_config_overrides_and_scheduler():
    """Overrides reach the torch optimizer's groups and the scheduler (per-group max_lr / min_lr / start_wd)."""
    from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    cfg = OptimizerConfig(optimizer="sgd", lr=1e-2, min_lr=1e-3, weight_decay=0.1, clip_grad=0.0)
    overrides = {ParamKey(name="1.*"): {"max_lr": 4e-2, "min_lr": 0.0, "start_wd": 0.0, "end_wd": 0.2},
                 ParamKey(name="*.bias"): {"wd_mult": 0.0}}
    opt = get_megatron_optimizer(cfg, [model], config_overrides=overrides)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="linear", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="linear")
    sched.step(5)
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    w0, b0, w1, b1 = (by_param[id(p)] for p in model.parameters())
    assert w0["lr"] == pytest.approx(1e-3 + 0.5 * (1e-2 - 1e-3)) and w0["weight_decay"] == pytest.approx(0.1)
    assert b0["weight_decay"] == 0.0 and w1["lr"] == pytest.approx(0.5 * 4e-2)
    assert w1["weight_decay"] == pytest.approx(0.1) and b1["weight_decay"] == 0.0  # start 0 -> end 0.2, halfway
    # megatron-core's positional order (config, model_chunks, config_overrides, ...) builds the same groups.
    positional = get_megatron_optimizer(cfg, [model], overrides, True, None)
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in positional.param_groups] == \
        [(g["max_lr"], 0.1 * g["wd_mult"], len(g["params"])) for g in opt.param_groups]
    with pytest.raises(ValueError, match="optimizer should not be overriden"):
        get_megatron_optimizer(cfg, [model], config_overrides={ParamKey(name="*"): {"optimizer": "adam"}})


def test_range():
    from megatron.core.optimizer.distrib_optimizer import Range

    r = Range(3, 10)
    assert (r.start, r.end, r.size, len(r), str(r), repr(r)) == (3, 10, 7, 7, "3,10 [7]", "3,10 [7]")
    moved = r.normalize(5)
    assert (moved.start, moved.end, moved.size) == (5, 12, 7) and r.normalize().start == 0


def test_buffer_type_and_partition_buckets():
    """Grouping only: fake buffers with the attributes partition_buckets reads."""
    from types import SimpleNamespace

    from megatron.core.distributed.param_and_grad_buffer import BufferType, partition_buckets

    assert [t.name for t in BufferType] == ["PARAM", "GRAD"] and BufferType.GRAD.value == 2
    assert partition_buckets([]) == []

    def buffer(dtype, n):
        buckets = [SimpleNamespace(params={object()}, name=f"{dtype}-{i}") for i in range(n)]
        return SimpleNamespace(param_dtype=dtype, buckets=buckets, ddp_config="cfg", data_parallel_group="dp",
                               data_parallel_world_size=2)

    def names(groups):
        return [[b.name for b in g.buckets] for g in groups]

    bf16, fp32, fp8 = buffer(torch.bfloat16, 2), buffer(torch.float32, 1), buffer(torch.uint8, 3)
    assert names(partition_buckets([bf16, fp32])) == [["torch.bfloat16-0"], ["torch.bfloat16-1"], ["torch.float32-0"]]
    single = partition_buckets([bf16, fp32], force_single_bucket_group=True)
    assert names(single) == [["torch.bfloat16-0", "torch.bfloat16-1", "torch.float32-0"]]
    assert single[0].data_parallel_world_size == 2 and len(single[0].params) == 3
    # fp8: the other buffers' buckets join the last fp8 group (the first layers').
    assert names(partition_buckets([bf16, fp8])) == [["torch.uint8-0"], ["torch.uint8-1"],
                                                     ["torch.uint8-2", "torch.bfloat16-0", "torch.bfloat16-1"]]
    with pytest.raises(ValueError, match="two buffers"):
        partition_buckets([bf16, buffer(torch.bfloat16, 1)])


def test_clip_qk_reduces_and_clips_supporting_layers(single_rank):
    from types import SimpleNamespace

    from megatron.core.optimizer.qk_clip import clip_qk

    clipped = []
    supporting = SimpleNamespace(core_attention=SimpleNamespace(current_max_attn_logits=torch.tensor([3.0, 7.5])),
                                 clip_qk=lambda: clipped.append(1))
    plain = SimpleNamespace()  # no clip_qk: skipped
    model = SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(self_attention=supporting),
                                                            SimpleNamespace(self_attention=plain)]))
    wrapped = SimpleNamespace(module=model)  # a DDP-style wrapper
    assert clip_qk([wrapped], log_max_only=True) == 7.5 and clipped == []
    assert clip_qk([wrapped]) == 7.5 and clipped == [1]
    assert clip_qk([SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(self_attention=plain)]))]) == 0.0


# ---------------------------------------------------------------------------------------------- ChainedOptimizer
def _chain_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _backward(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    ((model(x) - y) ** 2).sum().backward()


def test_chained_optimizer_matches_one_clipped_sgd(single_rank):
    """Two FP32Optimizers over the two layers, chained, against torch SGD over all parameters with the global
    norm clipped by torch.nn.utils.clip_grad_norm_."""
    import copy

    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig
    from megatron.core.optimizer.optimizer import ProxyDict

    model = _chain_model()
    reference = copy.deepcopy(model)
    cfg = OptimizerConfig(optimizer="sgd", lr=0.1, clip_grad=0.5, log_num_zeros_in_grad=True)
    parts = [FP32Optimizer(torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9), cfg)
             for layer in (model[0], model[2])]
    chained = ChainedOptimizer(parts)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        chained.zero_grad()
        ref_opt.zero_grad()
        _backward(model, step)
        _backward(reference, step)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item()
        ok, norm, zeros = chained.step()
        ref_opt.step()
        assert ok and norm == pytest.approx(ref_norm, rel=1e-5) and zeros == 0
    for ours, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert len(chained.param_groups) == 2 and chained.param_groups[1] is parts[1].param_groups[0]
    state = chained.state
    assert isinstance(state, ProxyDict) and len(state) == 4
    first = model[2].weight
    assert torch.equal(state[(1, first)]["momentum_buffer"], parts[1].optimizer.state[first]["momentum_buffer"])
    assert state[(0, first)] is None and set(state) == {(i, p) for i, o in enumerate(parts) for p in o.state}
    # Checkpoint round trip: one state dict per chained optimizer.
    saved = chained.state_dict()
    assert isinstance(saved, list) and len(saved) == 2
    fresh = ChainedOptimizer([FP32Optimizer(torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9), cfg)
                              for layer in (model[0], model[2])])
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state[(1, first)]["momentum_buffer"], state[(1, first)]["momentum_buffer"])
    with pytest.raises(RuntimeError, match="Expected 2 entries"):
        fresh.load_state_dict(saved[:1])
    single = ChainedOptimizer(parts[:1])
    assert single.optimizer is parts[0].optimizer and single.state_dict()["state"].keys() == saved[0]["state"].keys()
    with pytest.raises(AttributeError):
        chained.optimizer
    assert ChainedOptimizer([]).is_stub_optimizer


def test_chained_optimizer_skips_every_part_on_overflow(single_rank):
    from megatron.core.optimizer import ChainedOptimizer, ConstantGradScaler, OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    model = _chain_model().to(torch.float16)
    cfg = OptimizerConfig(optimizer="sgd", lr=0.1, fp16=True, loss_scale=8.0, clip_grad=0.0)
    parts = [Float16OptimizerWithFloat16Params(torch.optim.SGD(layer.parameters(), lr=0.1), cfg,
                                               ConstantGradScaler(8.0)) for layer in (model[0], model[2])]
    chained = ChainedOptimizer(parts)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[2].bias.grad[0] = float("inf")
    assert chained.step() == (False, None, None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for p in model.parameters():
        p.grad = torch.full_like(p, 8.0)
    assert chained.step()[0]
    assert torch.allclose(model[0].weight.float(), before[0].float() - 0.1, atol=1e-3)  # unscaled by 1/8


# ---------------------------------------------------------------------------------------------------------- Muon
def _polar(x):
    """The orthogonal polar factor U V^T of x = U S V^T, from an SVD in float64."""
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return (u @ vh).float()


@pytest.fixture
def highest_precision():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def test_newton_schulz_against_svd(highest_precision):
    from megatron.core.optimizer.muon import get_muon_scale_factor, newton_schulz

    g = torch.Generator().manual_seed(0)
    for shape in ((12, 20), (20, 12)):  # wide, and tall (run transposed)
        x = torch.randn(*shape, generator=g)
        # Polar Express ends on (15/8, -10/8, 3/8), which converges to U V^T.
        torch.testing.assert_close(newton_schulz(x, 30, "polar_express"), _polar(x), rtol=0, atol=1e-5)
        # Five quintic steps: same singular vectors, singular values near 1.
        u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
        core = u.T @ newton_schulz(x, 5, "quintic").double() @ vh.T
        assert (core - torch.diag(torch.diag(core))).abs().max() < 1e-5
        assert 0.7 < torch.diag(core).min() and torch.diag(core).max() < 1.25
    torch.set_float32_matmul_precision("medium")  # bf16 products: the same map, to bf16 accuracy
    x = torch.randn(12, 20, generator=g)
    torch.testing.assert_close(newton_schulz(x, 30, "polar_express"), _polar(x), rtol=0, atol=3e-2)
    assert get_muon_scale_factor(4, 9) == 3.0 and get_muon_scale_factor(9, 4, "unit_rms_norm") == 1.5
    assert get_muon_scale_factor(4, 9, "shape_scaling") == 1.0 and get_muon_scale_factor(9, 4, "shape_scaling") == 1.5


def test_tensor_parallel_muon_step_against_plain_restatement(highest_precision):
    """Two steps (decoupled weight decay, EMA momentum, Nesterov, per-block QKV, two scale modes) against the
    update written out with an SVD polar factor."""
    from megatron.core.optimizer.muon import TensorParallelMuon

    g = torch.Generator().manual_seed(1)
    dense = torch.nn.Parameter(torch.randn(6, 10, generator=g))
    qkv = torch.nn.Parameter(torch.randn(2 * (4 + 2 + 2), 10, generator=g))  # 2 query groups, q 4 / k 2 / v 2 rows
    qkv.is_qkv = True
    lr, beta, wd, extra = 0.05, 0.9, 0.1, 0.2
    for scale_mode, scale in (("spectral", lambda m, n: max(m, n) ** 0.5), ("unit_rms_norm", lambda m, n: (m / n) ** 0.5)):
        params = [dense.detach().clone().requires_grad_(), qkv.detach().clone().requires_grad_()]
        params[1].is_qkv = True
        opt = TensorParallelMuon(params, lr=lr, momentum_beta=beta, use_nesterov=True, weight_decay=wd,
                                 split_qkv=True, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                                 qkv_split_shapes=(4, 2, 2), fp32_matmul_prec="highest",
                                 coefficient_type="polar_express", num_ns_steps=40, scale_mode=scale_mode,
                                 extra_scale_factor=extra, mode="blockwise")
        expected = [p.detach().clone() for p in params]
        momenta = [torch.zeros_like(p) for p in params]
        for step in range(2):
            grads = [torch.randn(p.shape, generator=g) for p in params]
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
            for i, grad in enumerate(grads):
                expected[i] = expected[i] * (1 - lr * wd)
                momenta[i] = beta * momenta[i] + (1 - beta) * grad
                direction = (1 - beta) * grad + beta * momenta[i]
                if i == 0:
                    update = _polar(direction) * scale(6, 10)
                else:
                    blocks = direction.view(2, 8, 10).split([4, 2, 2], dim=1)
                    update = torch.cat([(_polar(b.reshape(-1, 10)) * scale(b.shape[0] * b.shape[1], 10))
                                        .view(2, -1, 10) for b in blocks], dim=1).view(16, 10)
                expected[i] = expected[i] - lr * extra * update
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.detach(), e, rtol=0, atol=2e-5)
        torch.testing.assert_close(opt.state[params[0]]["momentum_buffer"], momenta[0])


class _Chunk(torch.nn.Module):
    """A model chunk as get_megatron_muon_optimizer sees one: named parameters and a transformer config."""

    def __init__(self):
        from types import SimpleNamespace

        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=2, hidden_size=8)
        torch.manual_seed(3)
        self.embedding = torch.nn.Parameter(torch.randn(16, 8))
        self.embedding.is_embedding_or_output_parameter = True
        self.layer = torch.nn.Module()
        self.layer.linear_qkv = torch.nn.Linear(8, 2 * (4 + 2 + 2))  # weight [16, 8]: q 4 / k 2 / v 2 rows per group
        self.layer.norm = torch.nn.LayerNorm(8)
        self.layer.linear_fc1 = torch.nn.Linear(8, 12, bias=False)
        self.layer.experts = torch.nn.Module()
        self.layer.experts.weight1 = torch.nn.Parameter(torch.randn(8, 6))


def test_get_megatron_muon_optimizer_splits_matrices_from_the_rest(single_rank):
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.muon import TensorParallelMuon, get_megatron_muon_optimizer

    chunk = _Chunk()
    cfg = OptimizerConfig(optimizer="muon", lr=1e-2, min_lr=0.0, clip_grad=1.0, muon_fp32_matmul_prec="highest")
    with pytest.raises(ValueError, match="get_megatron_muon_optimizer"):
        get_megatron_optimizer(cfg, [chunk])
    opt = get_megatron_muon_optimizer(cfg, [chunk])
    assert isinstance(opt, ChainedOptimizer) and cfg.optimizer == "adam"
    muon, adam = opt.chained_optimizers
    assert isinstance(muon, FP32Optimizer) and isinstance(muon.optimizer, TensorParallelMuon)
    assert isinstance(adam.optimizer, torch.optim.AdamW)
    ids = {id(p): n for n, p in chunk.named_parameters()}
    assert sorted(ids[id(p)] for p in muon.get_parameters()) == [
        "layer.experts.weight1", "layer.linear_fc1.weight", "layer.linear_qkv.weight"]
    assert sorted(ids[id(p)] for p in adam.get_parameters()) == [
        "embedding", "layer.linear_qkv.bias", "layer.norm.bias", "layer.norm.weight"]
    assert muon.optimizer.qkv_split_shapes == [4, 2, 2] and chunk.layer.linear_qkv.weight.is_qkv
    assert chunk.layer.experts.weight1.expert_tp and all(p.requires_grad for p in chunk.parameters())
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    for p in chunk.parameters():
        p.grad = torch.ones_like(p)
    assert opt.step()[0]
    assert all(not torch.equal(before[n], p) for n, p in chunk.named_parameters())
    # bf16: fp32 main weights that keep the QKV / expert flags Muon reads.
    chunk16 = _Chunk().to(torch.bfloat16)
    for p in chunk16.parameters():
        p.grad = torch.ones_like(p)
    muon16 = get_megatron_muon_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [chunk16]).chained_optimizers[0]
    mains = {ids[id(p)]: m for p, m in zip(muon16.float16_groups[0], muon16.fp32_from_float16_groups[0])
             for ids in [{id(q): n for n, q in chunk16.named_parameters()}]}
    assert mains["layer.linear_qkv.weight"].is_qkv and mains["layer.experts.weight1"].expert_tp
    assert all(m.dtype == torch.float32 for m in mains.values())
    with pytest.raises(ValueError, match="distributed optimizer"):
        get_megatron_muon_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [chunk])
    with pytest.raises(ValueError, match="fp16"):
        get_megatron_muon_optimizer(OptimizerConfig(lr=1e-2, fp16=True), [chunk])


def _two_rank_body():
    """On 2 gloo ranks: Newton-Schulz of a matrix sharded over a TP group of 2 (both modes, both partition dims)
    against the unsharded iteration; LayerWiseDistributedOptimizer (DP = 2) against the unsharded chain."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer, newton_schulz, newton_schulz_tp

    torch.set_float32_matmul_precision("highest")
    rank, world = torch.distributed.get_rank(), torch.distributed.group.WORLD
    full = torch.randn(8, 12, generator=torch.Generator().manual_seed(5))
    reference = newton_schulz(full, 5, "quintic")
    ns_errors = {}
    for dim in (0, 1):
        shard = full.chunk(2, dim=dim)[rank]
        for mode in ("duplicated", "distributed"):
            ours = newton_schulz_tp(shard, 5, "quintic", world, partition_dim=dim, mode=mode)
            ns_errors[(dim, mode)] = (ours - reference.chunk(2, dim=dim)[rank]).abs().max().item()

    parallel_state.initialize_model_parallel(1, 1)  # DP = 2
    chunk, twin = _Chunk(), _Chunk()  # seeded: equal (a deepcopy would drop the parameters' attributes)
    cfg = OptimizerConfig(lr=1e-2, min_lr=0.0, clip_grad=0.05, muon_fp32_matmul_prec="highest")
    sharded = get_megatron_muon_optimizer(cfg, [chunk], layer_wise_distributed_optimizer=True)
    plain = get_megatron_muon_optimizer(OptimizerConfig(**{**cfg.__dict__}), [twin])
    assert isinstance(sharded, LayerWiseDistributedOptimizer)
    mine = sorted(n for n, p in chunk.named_parameters() if any(p is q for q in sharded.get_parameters()))
    norms = []
    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)  # the same (DP-reduced) gradients on both ranks
        for p, q in zip(chunk.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        norms.append((sharded.step()[1], plain.step()[1]))
    errors = [(p - q).abs().max().item() for p, q in zip(chunk.parameters(), twin.parameters())]
    parallel_state.destroy_model_parallel()
    return ns_errors, mine, norms, errors, [p.detach().clone() for p in chunk.parameters()]


def test_tensor_parallel_newton_schulz_and_layer_wise_optimizer_on_two_ranks():
    from helpers.dist_harness import run_distributed

    results = run_distributed(_two_rank_body, 2, timeout=120)
    for ns_errors, _, norms, errors, _ in results:
        assert max(ns_errors.values()) < 2e-5, ns_errors
        for sharded_norm, plain_norm in norms:
            assert sharded_norm == pytest.approx(plain_norm, rel=1e-5)
        assert max(errors) < 1e-6, errors
    # Whole parameters dealt by size in ping-pong order: each rank owns some, together all, none twice.
    owned = [set(r[1]) for r in results]
    assert owned[0] and owned[1] and not owned[0] & owned[1] and len(owned[0] | owned[1]) == 7
    for a, b in zip(results[0][4], results[1][4]):
        assert torch.equal(a, b)  # all-gathered: identical models
