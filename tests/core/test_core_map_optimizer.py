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
    with pytest.raises(ValueError, match="optimizer should not be overriden"):
        get_megatron_optimizer(cfg, [model], config_overrides={ParamKey(name="*"): {"optimizer": "adam"}})


def test_range():
    from megatron.core.optimizer.distrib_optimizer import Range

    r = Range(3, 10)
    assert (r.start, r.end, r.size, len(r), str(r), repr(r)) == (3, 10, 7, 7, "3,10 [7]", "3,10 [7]")
    moved = r.normalize(5)
    assert (moved.start, moved.end, moved.size) == (5, 12, 7) and r.normalize().start == 0
