"""Module-map names of issue 29 (config logger, heterogeneous transformers, attention builders, GraphableMegatronModule,
Fp4Recipe, ProcessGroupHelperMeta, fp8_utils / utils helpers) against the real megatron-core 0.16.1 (one oracle
subprocess for the module) or plain PyTorch.

The oracle parses the same Nemotron-NAS ``block_configs`` JSON (Hugging Face spellings: ``n_heads_in_group``,
``ffn_mult``, null, no-op and linear-replacement blocks), builds a GPTModel from its heterogeneous layer spec on CPU
(a 1-rank gloo group, a few ``torch.cuda`` calls stubbed in its process) and returns its state dict and logits; ours
loads that state dict (same keys) and must give the same logits and the same input gradient. The config logger's
JSON encoder, path counters and file names, ``is_first_last_bf16_layer`` and ``ProcessGroupHelperMeta`` run on both
sides on the same inputs.
"""
import json
import os
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from helpers.mcore_oracle import require_oracle, start_oracle
from helpers.models_helpers import causal_mask, single_rank  # noqa: F401  (fixture)
from helpers.numerics import rel_err

VOCAB, SEQ, BATCH, HIDDEN, HEADS = 96, 8, 2, 64, 4
# Four Nemotron-NAS blocks: GQA attention (2 groups) + MLP from ffn_mult; no-op attention + linear MLP; linear
# attention + MLP; MQA attention (1 group) + no-op MLP. A key the dataclasses do not know ("extra") is ignored.
BLOCKS = {"block_configs": [
    {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False, "extra": 1},
     "ffn": {"ffn_mult": 1.5, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
     "ffn": {"ffn_mult": None, "no_op": False, "replace_with_linear": True}},
    {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True},
     "mlp": {"ffn_hidden_size": 192, "no_op": False, "replace_with_linear": False}},
    {"attention": {"num_query_groups": 1, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": None, "no_op": True, "replace_with_linear": False}},
]}
CONFIG = dict(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=128,
              normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True, hidden_dropout=0.0,
              attention_dropout=0.0, layernorm_epsilon=1e-5, use_cpu_initialization=True)
BF16_CASES = [(True, 1, 1), (True, 2, 0), (True, 0, 3), (False, 1, 1)]

ORACLE = r"""
import json, os, sys, tempfile
from types import SimpleNamespace
import torch
torch.cuda.current_device = lambda: "cpu"
torch.cuda.is_available = lambda: False
torch.cuda.device_count = lambda: 0
torch.cuda.manual_seed = lambda *a, **k: None
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = lambda *a, **k: None
torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.random.set_rng_state = lambda *a, **k: None
cases = torch.load(sys.argv[1], weights_only=False)
out = {}
fd, init = tempfile.mkstemp(); os.close(fd); os.remove(init)
torch.distributed.init_process_group("gloo", init_method="file://" + init, rank=0, world_size=1)
from megatron.core import parallel_state as ps, tensor_parallel
ps.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(3)
from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig, MLPConfig
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.models.gpt import GPTModel
cfg = HeterogeneousTransformerConfig(**cases["config"], activation_func=torch.nn.functional.silu,
                                     heterogeneous_layers_config_path=cases["json_path"])
out["blocks"] = [(b.attention.no_op, b.attention.replace_with_linear, b.attention.num_query_groups, b.mlp.no_op,
                  b.mlp.replace_with_linear, b.mlp.ffn_hidden_size) for b in cfg.per_block_parameters]
out["per_layer"] = [(type(c).__name__, c.num_query_groups, c.ffn_hidden_size, c.heterogeneous_block_specs)
                    for c in (cfg.get_config_for_layer(n) for n in range(1, 5))]
out["encoded"] = cfg.heterogeneous_layers_config_encoded_json
out["ffn_mult"] = [MLPConfig.ffn_mult_to_intermediate_size(m, h) for m, h in cases["ffn_mults"]]
try:
    HeterogeneousTransformerConfig(**cases["config"], heterogeneous_layers_config_encoded_json=cases["bad_json"])
except AssertionError:
    out["bad"] = "refused"
spec = get_gpt_heterogeneous_layer_spec(cfg)
out["spec"] = [(s.submodules.input_layernorm.__name__, getattr(s.submodules.self_attention.module, "__name__", ""),
                s.submodules.self_attn_bda.__name__, getattr(s.submodules.mlp.module, "__name__", ""),
                s.submodules.mlp_bda.__name__, s.submodules.sharded_state_dict_keys_map) for s in spec.layer_specs]
model = GPTModel(cfg, spec, cases["vocab"], cases["seq"], position_embedding_type="rope")
emb = model.embedding.word_embeddings.weight
emb.register_hook(lambda g: out.__setitem__("emb_grad", g.clone()))
logits = model(cases["ids"], cases["pos"], cases["mask"])
(logits * cases["weights"]).sum().backward()
out["state"] = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
out["logits"] = logits.detach()
out["sharded"] = {k: (type(v).__name__, v.key, tuple(v.global_shape), tuple(v.global_offset))
                  for k, v in model.sharded_state_dict().items() if type(v).__name__ == "ShardedTensor"}
from megatron.core import config_logger as cl
from megatron.core.fp8_utils import is_first_last_bf16_layer
scope = {}
exec(cases["objects"], scope)
out["encoded_objects"] = json.dumps(scope["OBJECTS"], cls=cl.JSONEncoderWithMcoreTypes, sort_keys=True)
out["counts"] = [cl.get_path_count("a"), cl.get_path_count("a"), cl.get_path_count("b"), cl.get_path_with_count("a")]
cl.log_config_to_disk(SimpleNamespace(config_logger_dir=cases["log_dir"]), {"self": model.decoder, "x": 1})
cl.log_config_to_disk(SimpleNamespace(config_logger_dir=cases["log_dir"]), {"self": model.decoder, "x": 1})
cl.log_config_to_disk(SimpleNamespace(config_logger_dir=cases["log_dir"]), cases["ordered"], prefix="io", rank_str="7")
out["files"] = sorted(os.listdir(cases["log_dir"]))
out["bf16"] = [[is_first_last_bf16_layer(SimpleNamespace(num_layers=4, first_last_layers_bf16=on,
                                                         num_layers_at_start_in_bf16=s, num_layers_at_end_in_bf16=e), n)
                for n in range(-1, 5)] for on, s, e in cases["bf16_cases"]]
from megatron.core.enums import Fp4Recipe
out["fp4"] = [(m.name, m.value) for m in Fp4Recipe]
from megatron.core.process_groups_config import ProcessGroupHelperMeta
class Helper(metaclass=ProcessGroupHelperMeta):
    pass
Helper.tp = 2
try:
    Helper.virtual_pipeline_model_parallel_size = 2
    out["meta"] = (Helper.tp, "assigned")
except AttributeError as e:
    out["meta"] = (Helper.tp, str(e))
torch.save(out, sys.argv[2])
"""


# Values the config logger must write, built on each side (exec'd with that side's torch).
OBJECTS = """
import dataclasses, torch
from torch import nn
from types import SimpleNamespace
OBJECTS = {"dtype": torch.bfloat16, "builtin": len, "module": nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
           "leaf": nn.ReLU(), "list": [torch.float16, 1, "x"], "modlist": nn.ModuleList([nn.Identity()]),
           "cls": nn.Linear, "nested": {"d": torch.int8}, "other": range(3), "ns": SimpleNamespace(a=1),
           "dataclass": dataclasses.make_dataclass("P", [("a", int), ("b", list)])(a=1, b=[2])}
"""


def _objects():
    scope = {}
    exec(OBJECTS, scope)
    return scope["OBJECTS"]


def _json_path(tmp):
    path = tmp / "blocks.json"
    path.write_text(json.dumps(BLOCKS))
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def _oracle_started(tmp_path_factory):
    """The oracle's subprocess, started when the module starts: the in-process tests (first in this file) run on
    one core while it runs on the other. None without the oracle (its tests then skip)."""
    tmp = tmp_path_factory.mktemp("hetero_oracle")
    g = torch.Generator().manual_seed(11)
    cases = {"config": CONFIG, "json_path": _json_path(tmp), "vocab": VOCAB, "seq": SEQ,
             "ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             "pos": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(), "mask": causal_mask(SEQ),
             "weights": torch.randn(BATCH, SEQ, VOCAB, generator=g), "ffn_mults": [(2.625, 8192), (1.5, 64), (1.0, 96)],
             "bad_json": json.dumps({"layers": []}), "objects": OBJECTS, "log_dir": str(tmp / "oracle_logs"),
             "ordered": OrderedDict(a=torch.ones(2)), "bf16_cases": BF16_CASES}
    torch.save(cases, tmp / "cases.pt")
    try:
        run = start_oracle(["-c", ORACLE, tmp / "cases.pt", tmp / "out.pt"], cwd=tmp)
    except pytest.skip.Exception:
        run = None
    yield cases, tmp, run
    if run is not None and run.proc.poll() is None:
        run.proc.kill()
        run.proc.communicate()


@pytest.fixture(scope="module")
def oracle(_oracle_started):
    cases, tmp, run = _oracle_started
    if run is None:
        require_oracle()  # skips (fails under CI) with the reason
    run.result(timeout=300)
    return cases, torch.load(tmp / "out.pt", weights_only=False)


def _our_config(cases, **extra):
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    return HeterogeneousTransformerConfig(**CONFIG, activation_func=torch.nn.functional.silu, **extra)


def test_parallel_linear_predicates_and_graphable_module(single_rank):  # noqa: F811
    from megatron.core.fp8_utils import is_column_parallel_linear, is_row_parallel_linear
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered
    from megatron.core.transformer.module import GraphableMegatronModule, MegatronModule
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, add_bias_linear=True)
    init = torch.nn.init.zeros_
    col, row = ColumnParallelLinear(16, 8, config=config, init_method=init), RowParallelLinear(
        8, 16, config=config, init_method=init, input_is_parallel=True, skip_bias_add=False)
    gathered = ColumnParallelLinearGathered(config, layer_number=3, tp_comm_buffer_name="linear_attn")
    assert [is_column_parallel_linear(m) for m in (col, row, gathered, torch.nn.Linear(2, 2))] == \
        [True, False, True, False]
    assert [is_row_parallel_linear(m) for m in (col, row, gathered, torch.nn.Linear(2, 2))] == \
        [False, True, False, False]
    # The linear replacement: x W^T + b over the full hidden size (TP 1), extra keywords ignored, no bias returned.
    x = torch.randn(4, 2, 16)
    out, bias = gathered(x, attention_mask=None, rotary_pos_emb=None)
    assert bias is None and torch.allclose(out, torch.nn.functional.linear(x, gathered.weight, gathered.bias))
    with pytest.raises(ValueError, match="not supported for linear replacement"):
        gathered(x, runtime_gather_output=True)
    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
    assert isinstance(layer, GraphableMegatronModule) and isinstance(layer, MegatronModule)
    static = layer.get_layer_static_inputs(seq_length=6, micro_batch_size=3)["hidden_states"]
    assert static.shape == (6, 3, 16) and static.dtype == torch.bfloat16 and static.requires_grad
    layer.setup_manual_hooks(lambda: "hook")
    owners = {m for _, (m,) in layer.cuda_graph_manual_hooks}
    assert owners == {m for m in layer.modules() if next(m.parameters(recurse=False), None) is not None}


def test_wgrad_helpers_against_plain_torch():
    from megatron.core.utils import drain_embedding_wgrad_compute, prepare_input_tensors_for_wgrad_compute

    g = torch.Generator().manual_seed(5)
    grad, act = torch.randn(4, 3, 6, generator=g).transpose(0, 1), torch.randn(3, 4, 5, generator=g)
    g2, a2 = prepare_input_tensors_for_wgrad_compute(grad, act)
    assert g2.shape == (12, 6) and a2.shape == (12, 5) and g2.is_contiguous()
    assert torch.equal(g2, grad.reshape(12, 6)) and torch.equal(a2, act.reshape(12, 5))
    flat = torch.randn(7, 6, generator=g)
    assert prepare_input_tensors_for_wgrad_compute(flat, flat)[0].shape == (7, 6)

    acts = [torch.randn(3, 2, 5, generator=g) for _ in range(3)]
    grads = [torch.randn(3, 2, 6, generator=g) for _ in range(3)]
    weight = torch.nn.Parameter(torch.zeros(6, 5))
    weight.main_grad = torch.ones(6, 5)
    expected = torch.ones(6, 5) + sum(gr.reshape(-1, 6).t() @ a.reshape(-1, 5) for gr, a in zip(grads, acts))
    tp_group = SimpleNamespace(size=lambda: 1)
    act_buf, grad_buf = list(acts), list(grads)
    drain_embedding_wgrad_compute(SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=True),
                                  act_buf, grad_buf, weight, tp_group)
    assert act_buf == [] and grad_buf == [] and torch.allclose(weight.main_grad, expected, atol=1e-5)
    act_buf, grad_buf = list(acts), list(grads)
    drain_embedding_wgrad_compute(SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=False),
                                  act_buf, grad_buf, weight, tp_group)
    assert act_buf == [] and torch.allclose(weight.main_grad, expected, atol=1e-5)  # nothing added
    with pytest.raises(ValueError, match="equal lengths"):
        drain_embedding_wgrad_compute(SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=True),
                                      [acts[0]], [], weight, tp_group)


def test_training_flags_build_the_heterogeneous_gpt_and_log_configs(tmp_path, single_rank, monkeypatch):  # noqa: F811
    """--heterogeneous-layers-config-path through validate_args, core_transformer_config_from_args and
    pretrain_gpt.py's model_provider; --config-logger-dir through the model, DDP and the optimizer."""
    from helpers.args_test_helpers import validated
    from helpers.train_helpers import load_entry_point
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered
    from megatron.core.transformer.spec_utils import IdentityOp
    from megatron.training import global_vars
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.errors import ConfigurationError

    path, logs = _json_path(tmp_path), tmp_path / "logs"
    base = ("--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
            "--use-cpu-initialization --ffn-hidden-size 128 --hidden-dropout 0 --attention-dropout 0 "
            f"--heterogeneous-layers-config-path {path}")
    with pytest.raises(ConfigurationError, match="lists 4 blocks; --num-layers is 2"):
        validated(base + " --num-layers 2")
    with pytest.raises(ConfigurationError, match="cannot read"):
        validated(base + "-missing")
    args = validated(base + f" --config-logger-dir {logs}")
    assert json.loads(args.heterogeneous_layers_config_encoded_json) == BLOCKS  # kept in the checkpoint's args
    config = core_transformer_config_from_args(args)
    assert type(config).__name__ == "HeterogeneousTransformerConfig" and config.config_logger_dir == str(logs)
    args.padded_vocab_size = VOCAB
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    model = load_entry_point("pretrain_gpt").model_provider()
    layers = model.decoder.layers
    assert isinstance(layers[1].self_attention, IdentityOp) and isinstance(layers[1].mlp, ColumnParallelLinearGathered)
    assert isinstance(layers[2].self_attention, ColumnParallelLinearGathered) and isinstance(layers[3].mlp, IdentityOp)
    logits = model(cases_ids := torch.zeros(1, SEQ, dtype=torch.long), torch.arange(SEQ)[None], causal_mask(SEQ))
    assert logits.shape == (1, SEQ, VOCAB)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    # (a stand-in for the torch optimizer: torch.optim's first use imports torch._dynamo, seconds on this machine)
    FP32Optimizer(SimpleNamespace(param_groups=[{"params": list(ddp.parameters()), "lr": 0.1}]),
                  OptimizerConfig(config_logger_dir=str(logs)))
    files = sorted(os.listdir(logs))
    assert files == ["DistributedDataParallel.rank_0_0_0_0_0.iter0.json", "FP32Optimizer.rank_0_0_0_0_0.iter0.json",
                     "GPTModel.rank_0_0_0_0_0.iter0.json", "GPTModel_init_ckpt.rank_0_0_0_0_0.iter0.pth",
                     "input_and_logits.rank_0_0_0_0_0.iter0.pth"]
    gpt = json.loads((logs / files[2]).read_text())
    assert gpt["vocab_size"] == VOCAB and gpt["config"]["num_layers"] == 4 and "self" not in gpt
    saved = torch.load(logs / files[4])
    assert torch.equal(saved["input_ids"], cases_ids) and torch.equal(saved["logits"].transpose(0, 1), logits)
    assert torch.load(logs / files[3]).keys() == model.state_dict().keys()


def test_straggler_detector_times_regions_and_reports(single_rank, caplog):  # noqa: F811
    import logging
    import time

    from megatron.core.straggler_detector import StragglerDetector as Home
    from megatron.core.utils import StragglerDetector

    assert StragglerDetector is Home
    saved = StragglerDetector.__dict__.get("_configured")
    try:
        StragglerDetector._configured = False
        det = StragglerDetector()
        assert det is StragglerDetector() and not det.enabled
        with det:  # off: nothing is timed
            pass
        assert det.elapsed() == (0, 0, 0, 0, 0, 0)
        det.configure(world=1, rank=0, mmcnt=1, enabled=True)
        det.configure(world=5, rank=3)  # a second configure does nothing
        assert det.configured and det.enabled and det.world_size == 1 and det.my_rank == 0
        for _ in range(2):
            with det:
                time.sleep(0.01)
        with det(bdata=True):
            time.sleep(0.02)
        with det(bdata=True):
            time.sleep(0.005)
        delta, batch, *_ = det.elapsed()
        assert 20 <= delta < 1000 and 20 <= batch < 1000  # two compute regions summed; the longest data region
        assert det.elapsed()[:2] == (0.0, 0.0)  # elapsed() resets
        with det:
            time.sleep(0.01)
        with caplog.at_level(logging.INFO, logger="megatron.core.straggler_detector"):
            assert det.report(total_flops=4e12, log_interval=2)
        line = next(r.getMessage() for r in caplog.records if "MnRtt/Rnk" in r.getMessage())
        ptime = float(line.split("MnRtt/Rnk: ")[1].split("ms")[0])
        assert 4.5 <= ptime < 500  # one 10 ms region over 2 iterations
        etpt = float(line.split("MnEtpt/Rnk: ")[1].split("TF")[0])
        assert etpt == pytest.approx(4e12 / 2 / (ptime * 1e9) / 3.0, rel=0.02)  # amp 3: forward only
        det.toggle = True
        det.report(total_flops=4e12, log_interval=2)
        assert not det.enabled  # turned off at the report
        assert not det.report(total_flops=4e12, log_interval=2)  # off: nothing reported
    finally:
        StragglerDetector._configured = bool(saved)
        StragglerDetector().__init__()


def test_mamba_inference_state_config_from_model(single_rank, tmp_path):  # noqa: F811
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_mamba_inference_state_config_from_model

    h, head_dim, groups, state = 32, 8, 2, 4
    cfg = TransformerConfig(num_layers=3, hidden_size=h, num_attention_heads=4, normalization="RMSNorm",
                            add_bias_linear=False, mamba_state_dim=state, mamba_head_dim=head_dim,
                            mamba_num_groups=groups, use_cpu_initialization=True,
                            config_logger_dir=str(tmp_path / "logs"))
    model = MambaModel(cfg, get_mamba_stack_spec(), 64, 16, hybrid_layer_pattern="*M-")
    logged = json.loads((tmp_path / "logs" / "MambaModel.rank_0_0_0_0_0.iter0.json").read_text())
    assert logged["vocab_size"] == 64 and logged["hybrid_layer_pattern"] == "*M-"  # --config-logger-dir
    wrapped = SimpleNamespace(module=model)  # found through wrappers (.module)
    out = get_mamba_inference_state_config_from_model(wrapped)
    heads = 2 * h // head_dim  # Mamba-2: d_inner = 2 * hidden, heads = d_inner / head dim
    # conv channels: x (d_inner) + B and C (groups * state each); d_conv 4
    assert out.layer_type_list == ["*", "M", "-"]
    assert tuple(out.mamba_conv_states_shape) == (2 * h + 2 * groups * state, 4)
    assert tuple(out.mamba_ssm_states_shape) == (heads, head_dim, state)
    no_mamba = MambaModel(cfg, get_mamba_stack_spec(), 64, 16, hybrid_layer_pattern="*--")
    assert get_mamba_inference_state_config_from_model(no_mamba) is None
    assert no_mamba.decoder.mamba_state_shapes_per_request() is None


def test_first_last_layers_bf16_builds_those_layers_without_fp8(single_rank):  # noqa: F811
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, fp8="hybrid")
    with pytest.raises(ValueError, match="Delayed scaling does not support"):
        TransformerConfig(**base, first_last_layers_bf16=True)
    with pytest.raises(ValueError, match="num_layers_at_end_in_bf16 \\(5\\) must be between 0"):
        TransformerConfig(**base, fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_end_in_bf16=5)
    config = TransformerConfig(**base, fp8_recipe="tensorwise", first_last_layers_bf16=True,
                               num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, use_fp8=True)
    try:
        block = TransformerBlock(config, get_gpt_layer_local_spec())
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
    fp8_layers = [layer.self_attention.linear_qkv.fp8_meta is not None and layer.mlp.linear_fc2.fp8_meta is not None
                  for layer in block.layers]
    assert fp8_layers == [False, True, False, False]  # layer 0 (start) and layers 2, 3 (end) in bf16
    assert block.layers[0].config.fp8 is None and block.layers[1].config is config


# The tests that compare with the oracle run last (its subprocess started with the module).
def test_heterogeneous_config_parses_like_megatron_core(oracle, tmp_path):
    from megatron.core.transformer.heterogeneous.heterogeneous_config import MLPConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    cases, ref = oracle
    cfg = _our_config(cases, heterogeneous_layers_config_path=_json_path(tmp_path))
    blocks = [(b.attention.no_op, b.attention.replace_with_linear, b.attention.num_query_groups, b.mlp.no_op,
               b.mlp.replace_with_linear, b.mlp.ffn_hidden_size) for b in cfg.per_block_parameters]
    assert blocks == ref["blocks"]
    assert blocks[0][2] == 2 and blocks[0][5] == 256  # 4 heads / 2 per group; round_up(int(2*1.5*64/3), 256)
    per_layer = [(type(c).__name__, c.num_query_groups, c.ffn_hidden_size, c.heterogeneous_block_specs)
                 for c in (cfg.get_config_for_layer(n) for n in range(1, 5))]
    assert per_layer == ref["per_layer"]
    assert all(type(cfg.get_config_for_layer(n)) is TransformerConfig for n in (1, 4))
    assert cfg.heterogeneous_block_specs and cfg.heterogeneous_layers_config_encoded_json == ref["encoded"]
    assert [MLPConfig.ffn_mult_to_intermediate_size(m, h) for m, h in cases["ffn_mults"]] == ref["ffn_mult"]
    assert ref["ffn_mult"][0] == 14336  # Llama-3.3-Nemotron-Super-49B's first block
    # From the encoded JSON alone (as a checkpoint restores it), and the errors.
    again = _our_config(cases, heterogeneous_layers_config_encoded_json=ref["encoded"])
    assert [b.mlp.ffn_hidden_size for b in again.per_block_parameters] == [r[5] for r in ref["blocks"]]
    for bad in (0, 5):
        with pytest.raises(ValueError, match="Invalid layer number"):
            cfg.get_config_for_layer(bad)
    with pytest.raises(ValueError, match="block_configs"):
        _our_config(cases, heterogeneous_layers_config_encoded_json=cases["bad_json"])
    assert "bad" in ref  # the oracle refuses it too (an assertion there)
    odd = json.dumps({"block_configs": [{"attention": {"n_heads_in_group": 3}, "ffn": {"ffn_mult": 1.0}}]})
    with pytest.raises(ValueError, match="n_heads_in_group"):
        _our_config(cases, heterogeneous_layers_config_encoded_json=odd)


def test_heterogeneous_gpt_matches_megatron_core(oracle, single_rank):  # noqa: F811
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

    cases, ref = oracle
    cfg = _our_config(cases, heterogeneous_layers_config_encoded_json=ref["encoded"])
    spec = get_gpt_heterogeneous_layer_spec(cfg)
    ours_spec = [(s.submodules.input_layernorm.__name__, getattr(s.submodules.self_attention.module, "__name__", ""),
                  s.submodules.self_attn_bda.__name__, getattr(s.submodules.mlp.module, "__name__", ""),
                  s.submodules.mlp_bda.__name__, s.submodules.sharded_state_dict_keys_map) for s in spec.layer_specs]
    norm_free = [(a, b, c, d, e, f) for a, b, c, d, e, f in ref["spec"]]
    # Same modules and bias-dropout-adds; the norms are our FusedLayerNorm (RMSNorm here) where megatron-core
    # without apex uses torch's (same math), and IdentityOp where it does.
    assert [r[1:] for r in ours_spec] == [r[1:] for r in norm_free]
    assert [r[0] == "IdentityOp" for r in ours_spec] == [r[0] == "IdentityOp" for r in norm_free]
    model = GPTModel(cfg, spec, VOCAB, SEQ, position_embedding_type="rope")
    ours_keys = {k for k, v in model.state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k}
    assert ours_keys == {k for k in ref["state"] if "_extra_state" not in k}
    model.load_state_dict(ref["state"], strict=False)
    layer0 = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert tuple(layer0.shape) == (HIDDEN + 2 * 2 * HIDDEN // HEADS, HIDDEN)  # 2 query groups
    assert tuple(model.decoder.layers[2].mlp.linear_fc1.weight.shape) == (2 * 192, HIDDEN)  # gated, per block
    logits = model(cases["ids"], cases["pos"], cases["mask"])
    assert rel_err(logits.detach(), ref["logits"]) <= 1e-5
    (logits * cases["weights"]).sum().backward()
    assert rel_err(model.embedding.word_embeddings.weight.grad, ref["emb_grad"]) <= 1e-5
    # Layer-per-key checkpoints (non-homogeneous layers) with the spec's norm renames.
    sharded = {k: (type(v).__name__, v.key, tuple(v.global_shape), tuple(v.global_offset))
               for k, v in model.sharded_state_dict().items() if type(v).__name__ == "ShardedTensor"}
    assert sharded == ref["sharded"]
    assert sharded["decoder.layers.2.input_layernorm.weight"][1] == "decoder.layers.2.self_attention.layer_norm_weight"


def test_config_logger_matches_megatron_core(oracle, tmp_path, single_rank):  # noqa: F811
    from megatron.core import config_logger as cl
    from megatron.core.transformer.transformer_block import TransformerBlock

    cases, ref = oracle
    assert json.dumps(_objects(), cls=cl.JSONEncoderWithMcoreTypes, sort_keys=True) == ref["encoded_objects"]
    cl._path_counts.clear()
    assert [cl.get_path_count("a"), cl.get_path_count("a"), cl.get_path_count("b"), cl.get_path_with_count("a")] \
        == ref["counts"]
    assert not cl.has_config_logger_enabled(SimpleNamespace()) and cl.get_config_logger_path(SimpleNamespace()) == ""
    config = SimpleNamespace(config_logger_dir=str(tmp_path / "logs"))
    assert cl.has_config_logger_enabled(config)
    block = TransformerBlock.__new__(TransformerBlock)  # the file is named after the class of dict_data["self"]
    data = {"self": block, "x": 1}
    cl.log_config_to_disk(config, data)
    assert "self" not in data
    cl.log_config_to_disk(config, {"self": block, "x": 1})
    cl.log_config_to_disk(config, cases["ordered"], prefix="io", rank_str="7")
    assert sorted(os.listdir(tmp_path / "logs")) == ref["files"]
    assert json.loads((tmp_path / "logs" / "TransformerBlock.rank_0_0_0_0_0.iter1.json").read_text()) == {"x": 1}
    assert torch.equal(torch.load(tmp_path / "logs" / "io.rank_7.iter0.pth")["a"], torch.ones(2))


def test_small_names_match_megatron_core(oracle):
    from megatron.core.enums import Fp4Recipe
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.process_groups_config import ProcessGroupHelperMeta

    _, ref = oracle
    ours = [[is_first_last_bf16_layer(SimpleNamespace(num_layers=4, first_last_layers_bf16=on,
                                                      num_layers_at_start_in_bf16=s, num_layers_at_end_in_bf16=e), n)
             for n in range(-1, 5)] for on, s, e in BF16_CASES]
    assert ours == ref["bf16"]
    assert [(m.name, m.value) for m in Fp4Recipe] == ref["fp4"] and Fp4Recipe("nvfp4") == "nvfp4"

    class Helper(metaclass=ProcessGroupHelperMeta):
        pass

    Helper.tp = 2
    with pytest.raises(AttributeError) as err:
        Helper.virtual_pipeline_model_parallel_size = 2
    assert (Helper.tp, str(err.value)) == ref["meta"]
