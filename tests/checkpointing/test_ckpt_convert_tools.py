"""tools/checkpoint/convert.py: Hugging Face -> legacy (2,2) -> (1,1) -> (4,1) -> Hugging Face, GPT-2 and Llama.

Small random Hugging Face models are built here (no download) and saved with ``save_pretrained``. Checks:
the final Hugging Face export holds exactly the original tensors; the logits of our GPTModel loaded from the
(2,2), (1,1) and (4,1) legacy checkpoints equal each other and transformers' logits within 1e-5 relative; unsupported
requests fail with a message naming the problem.
"""
import os
import subprocess
import sys

import pytest
import torch

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(REPO, "tools", "checkpoint", "convert.py")
REL_TOL = 1e-5
SEQ, BATCH, VOCAB = 12, 2, 100


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: random values show a dropped or misplaced norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _convert(*argv, subprocess_run=False):
    """Run the converter: in this process (fast), or as the command-line script."""
    argv = ["--model-type", "GPT", *argv]
    if not subprocess_run:
        from tools.checkpoint import convert
        convert.convert(convert.get_args(argv))
        return None
    proc = subprocess.run([sys.executable, CONVERT, *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO})
    return proc


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, pos, mask


def _rank_file(ckpt, tp_rank, pp_rank, pp):
    name = "mp_rank_{:02d}".format(tp_rank) + ("_{:03d}".format(pp_rank) if pp > 1 else "")
    return os.path.join(ckpt, "release", name, "model_optim_rng.pt")


def logits_body(cases):
    """Our legacy GPTModel at (tp, pp) loaded from a converted checkpoint; logits on the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.conversion import hf
    from megatron.model import GPTModel

    ids, pos, mask = _inputs()
    out = {}
    for name, family, cfg_dict, ckpt, tp, pp in cases:
        ps.initialize_model_parallel(tp, pp)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        cls, to_config = ((transformers.GPT2Config, hf.gpt2_config_to_megatron) if family == "gpt2"
                          else (transformers.LlamaConfig, hf.llama_config_to_megatron))
        config = to_config(cls.from_dict(cfg_dict), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           pipeline_dtype=torch.float32, use_cpu_initialization=True)
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = GPTModel(config, parallel_output=False, pre_process=first, post_process=last).eval()
        state = torch.load(_rank_file(ckpt, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                      pp), map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        with torch.no_grad():
            if not last:
                hidden = model(ids, pos, mask)
                torch.distributed.send(hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            else:
                if not first:
                    hidden = torch.empty(SEQ, BATCH, config.hidden_size)
                    torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                    model.set_input_tensor(hidden)
                logits = model(ids, pos, mask)
                if ps.get_tensor_model_parallel_rank() == 0:
                    out[name] = logits[..., :VOCAB].clone()
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_convert")
    result = {}
    for family, build in (("gpt2", _gpt2), ("llama", _llama)):
        model = build()
        src, a, b, c, back = (str(root / f"{family}_{n}") for n in ("hf", "tp2pp2", "tp1pp1", "tp4pp1", "hf_back"))
        model.save_pretrained(src, safe_serialization=True)
        proc = _convert("--loader", "hf", "--saver", "legacy", "--load-dir", src, "--save-dir", a,
                        "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                        subprocess_run=family == "gpt2")  # the script itself once
        assert proc is None or proc.returncode == 0, proc.stderr + proc.stdout
        _convert("--loader", "legacy", "--saver", "legacy", "--load-dir", a, "--save-dir", b,
                 "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1",
                 "--true-vocab-size", str(VOCAB), "--megatron-path", REPO)
        _convert("--loader", "legacy", "--saver", "legacy", "--load-dir", b, "--save-dir", c,
                 "--target-tensor-parallel-size", "4", "--target-pipeline-parallel-size", "1")
        _convert("--loader", "legacy", "--saver", "hf", "--load-dir", c, "--save-dir", back)
        with torch.no_grad():
            ref = model(_inputs()[0]).logits
        result[family] = {"model": model, "dirs": (src, a, b, c, back), "ref": ref}
    return result


def test_hf_round_trip_is_exact(converted):
    for family, r in converted.items():
        src, _, _, _, back = r["dirs"]
        original = load_file(os.path.join(src, "model.safetensors"))
        exported = load_file(os.path.join(back, "model.safetensors"))
        assert set(original) == set(exported), (family, set(original) ^ set(exported))
        for key in original:
            assert torch.equal(original[key], exported[key]), f"{family}: {key} changed in HF -> ours -> HF"
        reloaded = type(r["model"]).from_pretrained(back).eval()
        with torch.no_grad():
            assert torch.equal(reloaded(_inputs()[0]).logits, r["ref"]), family


def test_converted_logits_match_transformers_and_each_other(converted):
    cases = []
    for family, r in converted.items():
        _, a, b, c, _ = r["dirs"]
        cfg = r["model"].config.to_dict()
        cases += [(f"{family} 2x2", family, cfg, a, 2, 2), (f"{family} 1x1", family, cfg, b, 1, 1),
                  (f"{family} 4x1", family, cfg, c, 4, 1)]
    outputs = run_distributed(logits_body, 4, cases, timeout=180)
    merged = {}
    for rank_out in outputs:
        merged.update(rank_out)
    report = []
    for family, r in converted.items():
        original = merged[f"{family} 2x2"]
        for layout in ("2x2", "1x1", "4x1"):
            logits = merged[f"{family} {layout}"]
            vs_hf, vs_original = rel_err(logits, r["ref"]), rel_err(logits, original)
            report.append(f"{family} {layout}: vs transformers {vs_hf:.2e}, vs (2,2) {vs_original:.2e}")
            assert vs_hf <= REL_TOL and vs_original <= REL_TOL, "\n".join(report)
    print("\n".join(report))


def test_clear_errors(converted, tmp_path):
    from tools.checkpoint.legacy_io import ConversionError

    _, a, _, _, _ = converted["gpt2"]["dirs"]
    with pytest.raises(ConversionError, match="--target-tensor-parallel-size 3 must divide the 4 attention heads"):
        _convert("--loader", "legacy", "--saver", "legacy", "--load-dir", a, "--save-dir", str(tmp_path / "x"),
                 "--target-tensor-parallel-size", "3", "--true-vocab-size", str(VOCAB))
    with pytest.raises(ConversionError, match="--target-pipeline-parallel-size 3 does not divide num_layers 4"):
        _convert("--loader", "legacy", "--saver", "legacy", "--load-dir", a, "--save-dir", str(tmp_path / "y"),
                 "--target-pipeline-parallel-size", "3")
    with pytest.raises(ConversionError, match="supported loaders are legacy"):
        _convert("--loader", "nemo", "--saver", "legacy", "--load-dir", a, "--save-dir", str(tmp_path / "z"))
    with pytest.raises(ConversionError, match="latest_checkpointed_iteration.txt not found"):
        _convert("--loader", "legacy", "--saver", "legacy", "--load-dir", str(tmp_path), "--save-dir",
                 str(tmp_path / "w"))
    proc = _convert("--loader", "hf", "--saver", "hf", "--load-dir", a, "--save-dir", str(tmp_path / "u"),
                    subprocess_run=True)
    assert proc.returncode == 1 and proc.stderr.startswith("error: --loader hf --saver hf converts nothing")
