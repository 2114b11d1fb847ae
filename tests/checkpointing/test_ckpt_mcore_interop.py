"""torch_dist interop with the real megatron-core 0.16.1 (run in a subprocess, tests/checkpointing/mcore_oracle_child.py).

Direction 1: megatron-core builds a GPT-2-shaped and a Llama-shaped GPT (local spec, 4 layers, hidden 64) at TP=1
and TP=2, saves it with ``dist_checkpointing.save`` and records its logits; we load the directory at TP=1, TP=2 and
PP=2 and compare our logits. Direction 2: we save our model (TP=2 and PP=2) in the torch_dist format; megatron-core
loads it at TP=1 and compares its logits with ours. Tolerance 1e-5 relative (max |a-e| / max |e|).

Every case runs in three launches shared by the module (one fixture): the oracle saves all four checkpoints, our two
ranks load them all and save ours, the oracle loads ours; the tests then read their part.

The oracle's location comes from $MCORE_ORACLE_DIR (.ci/run installs it in <repo>/.venv/mcore-oracle). Without
it the tests skip, except under CI (``$CI`` set), where they fail.
"""
import os

import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.mcore_oracle import require_oracle, run_oracle
from helpers.numerics import rel_err

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_oracle_child.py")
VOCAB, SEQ, HIDDEN, LAYERS = 100, 8, 64, 4
TOL = 1e-5
pytestmark = pytest.mark.timeout(600)  # an oracle subprocess per case; ~1 min each on an idle 2-core machine


@pytest.fixture(scope="module")
def oracle():
    return require_oracle()


def _run_oracle(oracle, tmp, jobs):
    """Run the oracle's jobs (dicts: mode, style, tp, pp, ckpt, out) in one launch of 2 ranks."""
    import json

    jobs_file = os.path.join(str(tmp), f"jobs_{jobs[0]['mode']}.json")
    with open(jobs_file, "w") as f:
        json.dump([{k: str(v) if k in ("ckpt", "out") else v for k, v in job.items()} for job in jobs], f)
    run_oracle([CHILD, jobs_file], cwd=tmp)


# The oracle's "deepseek" model (mcore_oracle_child.DEEPSEEK), written out again: multi-latent attention with query
# compression, latent norms and YaRN; a dense first layer then an MoE layer (sigmoid routing, expert bias, a shared
# expert); one MTP depth.
DEEPSEEK = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                qk_pos_emb_head_dim=4, v_head_dim=8, rotary_scaling_factor=4.0, original_max_position_embeddings=4,
                mscale=1.0, mscale_all_dim=0.5, qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
                add_bias_linear=False, ffn_hidden_size=96, num_moe_experts=4, moe_layer_freq=[0, 1],
                moe_ffn_hidden_size=24, moe_router_topk=2, moe_shared_expert_intermediate_size=24,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.0, mtp_num_layers=1,
                mtp_loss_scaling_factor=0.3, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                gated_linear_unit=True, bias_activation_fusion=False, position_embedding_type="rope")


def _deepseek_model(tp, ep):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                  expert_model_parallel_size=ep, activation_func=torch.nn.functional.silu, **DEEPSEEK)
    return GPTModel(config, get_gpt_decoder_block_spec(config), VOCAB, SEQ)


def _deepseek_outputs(model):
    """{'logits', 'mtp'} as the oracle child records them: a training-mode forward with labels (the last slot
    masked), the main logits and each MTP depth's logged loss."""
    from megatron.core import tensor_parallel

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 90, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    loss_mask = torch.ones(2, SEQ)
    loss_mask[:, -1] = 0
    model.train()
    model(ids, pos, mask, labels=torch.roll(ids, -1, dims=1), loss_mask=loss_mask)
    mtp = torch.stack([model.mtp.tracked_losses[k] for k in sorted(model.mtp.tracked_losses)])
    model.mtp.tracked_losses.clear()
    with torch.no_grad():
        logits = model(ids, pos, mask)
    return {"logits": tensor_parallel.gather_from_tensor_model_parallel_region(logits).float(), "mtp": mtp}


def _our_model(style, tp, pp, ep=1):
    import torch.nn.functional as F

    from helpers.models_helpers import tiny_config
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    over = dict(num_layers=LAYERS, hidden_size=HIDDEN, padded_vocab_size=VOCAB, max_position_embeddings=SEQ)
    if style in ("llama", "mixtral"):
        over.update(num_query_groups=2, ffn_hidden_size=96)
    else:
        over.update(ffn_hidden_size=4 * HIDDEN, activation_func=F.gelu)
    if style == "mixtral":  # the oracle's MoE: 4 experts of width 48, top-2, SequentialMLP, allgather dispatcher
        over.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, expert_model_parallel_size=ep)
    config = tiny_config(tp=tp, pp=pp, style="gpt2" if style == "gpt2" else "llama", **over)
    spec = get_gpt_decoder_block_spec(config) if style == "mixtral" else get_gpt_layer_local_spec()
    return GPTModel(config, spec, VOCAB, SEQ, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(), parallel_output=False,
                    share_embeddings_and_output_weights=style == "gpt2",
                    position_embedding_type="learned_absolute" if style == "gpt2" else "rope")


def _logits(model):
    """Logits of the oracle's fixed batch through a hand-run pipeline; on the last stage, else None."""
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 90, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(SEQ, 2, HIDDEN)
            torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        y = model(ids, pos, mask)
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(y.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
    return y.float()


def _setup(tp, pp, seed, ep=1):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


LOAD_LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (TP, PP) on 2 ranks (TP=1 PP=1 is DP=2)
SAVE_LAYOUTS = ((2, 1, 1), (1, 2, 2))  # (TP, PP, TP megatron-core loads it with)
STYLES, SAVED_TPS = ("gpt2", "llama"), (1, 2)


def load_body(style, directory):
    """Our model loads ``directory`` at every layout of LOAD_LAYOUTS; {layout: logits} on the last stage."""
    from megatron.training.checkpointing import torch_dist as dc

    out = {}
    for tp, pp in LOAD_LAYOUTS:
        _setup(tp, pp, 99)  # another seed than the oracle's: the weights must come from the checkpoint
        model = _our_model(style, tp, pp)
        request = dc.model_sharded_state([model], for_load=True)
        dc.load_sharded_checked(request, directory, "raise_all", [k for k in request if "word_embeddings" in k])
        dc.apply_loaded_model([model], request)
        out[(tp, pp)] = _logits(model)
    return out


def save_body(style, root):
    """Our model (seed 4321) saved at each layout of SAVE_LAYOUTS under root/ours_{style}_tp{TP}_pp{PP}; its logits."""
    import json

    from megatron.core.dist_checkpointing import save_sharded
    from megatron.training.checkpointing import torch_dist as dc

    out = {}
    for tp, pp, _ in SAVE_LAYOUTS:
        directory = os.path.join(root, f"ours_{style}_tp{tp}_pp{pp}")
        _setup(tp, pp, 4321)
        model = _our_model(style, tp, pp)
        save_sharded(dc.model_sharded_state([model]), directory)
        if torch.distributed.get_rank() == 0:
            torch.save({}, os.path.join(directory, "common.pt"))
            with open(os.path.join(directory, "metadata.json"), "w") as f:
                json.dump(dc.METADATA, f)
        torch.distributed.barrier()
        out[(tp, pp)] = _logits(model)
    return out


def describe_body(style, tp, pp=1, ep=1):
    """What our model declares (``sharded_state_dict``) at (tp, pp, ep), described as the oracle child describes
    megatron-core's."""
    from checkpointing.mcore_oracle_child import describe_sharded

    _setup(tp, pp, 5, ep)
    return describe_sharded(_our_model(style, tp, pp, ep).sharded_state_dict())


def ours_body(root):
    """One launch of our 2 ranks: load every oracle checkpoint at every layout, then save ours for both styles;
    describe our sharded state at the oracle's save layouts."""
    loaded = {(style, saved_tp): load_body(style, os.path.join(root, f"mcore_{style}_tp{saved_tp}"))
              for style in STYLES for saved_tp in SAVED_TPS}
    saved = {style: save_body(style, root) for style in STYLES}
    described = {(style, tp): describe_body(style, tp) for style in STYLES for tp in SAVED_TPS}
    return {"loaded": loaded, "saved": saved, "described": described, "moe": moe_body(root)}


def _compare_described(ours, theirs, label):
    """One line per difference between our description and megatron-core's (same rank, same model)."""
    ours, theirs = set(ours), set(theirs)
    lines = [f"{label} only ours: {x}" for x in sorted(ours - theirs)]
    lines += [f"{label} only megatron-core: {x}" for x in sorted(theirs - ours)]
    return lines


@pytest.mark.parametrize("style", STYLES)
def test_sharded_state_dict_matches_megatron_core(interop, style):
    """Our ``model.sharded_state_dict()`` declares, on every rank, exactly what megatron-core 0.16.1's declares for
    the same model (TP=1 x DP=2 and TP=2): state-dict keys, checkpoint keys, global shapes and offsets, local shapes,
    grids, replica ids, prepended axes, allow_shape_mismatch (factories built: the gated fc1 halves)."""
    root, outputs = interop
    problems, count = [], 0
    for tp in SAVED_TPS:
        for rank, out in enumerate(outputs):
            theirs = torch.load(root / f"ref_{style}_tp{tp}.pt.sharded{rank}")
            count += len(theirs)
            problems += _compare_described(out["described"][(style, tp)], theirs, f"{style} TP={tp} rank {rank}")
    print(f"{style}: {count} sharded leaves compared with megatron-core, {len(problems)} differences")
    assert not problems, "\n".join(problems[:30])


@pytest.fixture(scope="module")
def interop(oracle, tmp_path_factory):
    """One oracle launch saving every megatron-core checkpoint (dense and MoE), one launch of our ranks loading and
    saving (:func:`ours_body`, :func:`moe_body`), one oracle launch loading ours."""
    root = tmp_path_factory.mktemp("mcore_interop")
    _run_oracle(oracle, root, [dict(mode="save", style=style, tp=tp, pp=1, ckpt=root / f"mcore_{style}_tp{tp}",
                                    out=root / f"ref_{style}_tp{tp}.pt") for style in STYLES for tp in SAVED_TPS]
                + _moe_save_jobs(root))
    outputs = run_distributed(ours_body, 2, str(root), timeout=400)
    _run_oracle(oracle, root, [dict(mode="load", style=style, tp=load_tp, pp=1, ckpt=root / f"ours_{style}_tp{tp}_pp{pp}",
                                    out=root / f"mcore_from_{style}_tp{tp}_pp{pp}.pt")
                               for style in STYLES for tp, pp, load_tp in SAVE_LAYOUTS] + _moe_load_jobs(root))
    return root, outputs


def _last(outputs, layout):
    return next(o[layout] for o in outputs if o[layout] is not None)


@pytest.mark.parametrize("style,saved_tp", [("gpt2", 1), ("gpt2", 2), ("llama", 1), ("llama", 2)])
def test_megatron_core_checkpoints_load_here(interop, style, saved_tp):
    root, outputs = interop
    expected = torch.load(root / f"ref_{style}_tp{saved_tp}.pt")
    loaded = [o["loaded"][(style, saved_tp)] for o in outputs]
    report = []
    for tp, pp in LOAD_LAYOUTS:
        err = rel_err(_last(loaded, (tp, pp)), expected)
        report.append(f"{style} megatron-core TP={saved_tp} -> ours TP={tp} PP={pp}: max rel diff {err:.2e}")
    print("\n".join(report))
    assert all(float(r.rsplit(" ", 1)[1]) <= TOL for r in report), "\n".join(report)


@pytest.mark.parametrize("style", STYLES)
def test_megatron_core_loads_our_checkpoints(interop, style):
    root, outputs = interop
    saved = [o["saved"][style] for o in outputs]
    report = []
    for tp, pp, load_tp in SAVE_LAYOUTS:
        err = rel_err(torch.load(root / f"mcore_from_{style}_tp{tp}_pp{pp}.pt"), _last(saved, (tp, pp)))
        report.append(f"{style} ours TP={tp} PP={pp} -> megatron-core TP={load_tp}: max rel diff {err:.2e}")
    print("\n".join(report))
    assert all(float(r.rsplit(" ", 1)[1]) <= TOL for r in report), "\n".join(report)


MOE_LOAD_LAYOUTS = ((1, 1, 2), (1, 1, 1), (1, 2, 1))  # (TP, PP, EP) on 2 ranks


DEEPSEEK_LOAD_LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (TP, EP) on 2 ranks; TP = 2 with sequence parallelism


def _save(model, directory):
    import json

    from megatron.core.dist_checkpointing import save_sharded
    from megatron.training.checkpointing import torch_dist as dc

    save_sharded(dc.model_sharded_state([model]), directory)
    if torch.distributed.get_rank() == 0:
        torch.save({}, os.path.join(directory, "common.pt"))
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            json.dump(dc.METADATA, f)
    torch.distributed.barrier()


def moe_body(root):
    """One launch of our 2 ranks: load megatron-core's Mixtral-style and DeepSeek-style checkpoints at several layouts,
    then save ours (Mixtral-style at EP = 2, DeepSeek-style at TP = 2 + SP)."""
    from megatron.training.checkpointing import torch_dist as dc

    out = {"described": describe_body("mixtral", 1, 1, 2)}
    for tp, pp, ep in MOE_LOAD_LAYOUTS:
        _setup(tp, pp, 99, ep)
        model = _our_model("mixtral", tp, pp, ep).eval()
        directory = os.path.join(root, "mcore_ep2")
        request = dc.model_sharded_state([model], for_load=True)
        dc.load_sharded_checked(request, directory, "raise_all", [k for k in request if "word_embeddings" in k])
        dc.apply_loaded_model([model], request)
        out[(tp, pp, ep)] = _logits(model)
    for tp, ep in DEEPSEEK_LOAD_LAYOUTS:
        _setup(tp, 1, 99, ep)
        model = _deepseek_model(tp, ep)
        request = dc.model_sharded_state([model], for_load=True)
        dc.load_sharded_checked(request, os.path.join(root, "mcore_deepseek"), "raise_all",
                                [k for k in request if "word_embeddings" in k])
        dc.apply_loaded_model([model], request)
        out[("deepseek", tp, ep)] = _deepseek_outputs(model)
    _setup(1, 1, 4321, 2)
    model = _our_model("mixtral", 1, 1, 2).eval()
    _save(model, os.path.join(root, "ours_ep2"))
    out["saved"] = _logits(model)
    _setup(2, 1, 4321, 1)
    model = _deepseek_model(2, 1)
    _save(model, os.path.join(root, "ours_deepseek"))
    out["saved deepseek"] = _deepseek_outputs(model)
    return out


def _moe_save_jobs(root):
    return [dict(mode="save", style="mixtral", tp=1, pp=1, ep=2, ckpt=root / "mcore_ep2", out=root / "ref.pt"),
            dict(mode="save", style="deepseek", tp=1, pp=1, ep=2, ckpt=root / "mcore_deepseek",
                 out=root / "ref_deepseek.pt")]


def _moe_load_jobs(root):
    return [dict(mode="load", style="mixtral", tp=1, pp=1, ep=1, ckpt=root / "ours_ep2",
                 out=root / "mcore_from_ours.pt"),
            dict(mode="load", style="deepseek", tp=1, pp=1, ep=1, ckpt=root / "ours_deepseek",
                 out=root / "mcore_from_ours_deepseek.pt")]


def test_moe_checkpoints_move_both_ways_with_megatron_core(interop):
    """MoE (4 experts, top-2, SequentialMLP): megatron-core at EP=2 saves, we load at EP=2, EP=1 and PP=2; we save
    at EP=2, megatron-core loads at EP=1. Same logits (expert keys [L, E, ...], gate/up halves, _extra_state).

    DeepSeek-style (multi-latent attention, a dense then an MoE layer, one MTP depth; the oracle child's stand-ins for
    what megatron-core's local spec lacks on CPU): megatron-core at EP=2 saves (local-spec key names, per-layer keys
    of the heterogeneous stack, mtp.layers.0.*), we load at TP=1, TP=2 + SP and EP=2: equal logits and MTP loss; we
    save at TP=2 + SP (Transformer Engine's norm names), megatron-core loads it at TP=1 with its TE-spec keys: equal
    logits and MTP loss."""
    tmp_path, outputs = interop  # (the interop fixture's launches ran the MoE jobs and moe_body too)
    outputs = [o["moe"] for o in outputs]
    expected = torch.load(tmp_path / "ref.pt")
    differences = [d for rank, o in enumerate(outputs) for d in _compare_described(
        o["described"], torch.load(tmp_path / f"ref.pt.sharded{rank}"), f"mixtral EP=2 rank {rank}")]
    assert not differences, "our MoE sharded_state_dict differs from megatron-core's:\n" + "\n".join(differences[:30])
    report = []
    for layout in MOE_LOAD_LAYOUTS:
        err = rel_err(_last(outputs, layout), expected)
        report.append(f"mixtral megatron-core EP=2 -> ours (TP, PP, EP)={layout}: max rel diff {err:.2e}")
    ours = next(o["saved"] for o in outputs if o["saved"] is not None)
    err = rel_err(torch.load(tmp_path / "mcore_from_ours.pt"), ours)
    report.append(f"mixtral ours EP=2 -> megatron-core EP=1: max rel diff {err:.2e}")
    expected = torch.load(tmp_path / "ref_deepseek.pt")
    for tp, ep in DEEPSEEK_LOAD_LAYOUTS:
        got = outputs[0][("deepseek", tp, ep)]
        for what in ("logits", "mtp"):
            err = rel_err(got[what], expected[what])
            report.append(f"deepseek megatron-core EP=2 -> ours TP={tp} EP={ep} {what}: max rel diff {err:.2e}")
    theirs = torch.load(tmp_path / "mcore_from_ours_deepseek.pt")
    for what in ("logits", "mtp"):
        err = rel_err(theirs[what], outputs[0]["saved deepseek"][what])
        report.append(f"deepseek ours TP=2 + SP -> megatron-core TP=1 {what}: max rel diff {err:.2e}")
    print("\n".join(report))
    assert all(float(r.rsplit(" ", 1)[1]) <= TOL for r in report), "\n".join(report)
