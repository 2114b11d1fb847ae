"""Check the GPU fast path item by item; print PASS / FAIL / SKIP with a reason for each.

    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/check_gpu_fast_path.py        # on one GPU (H100)
    python benchmarks/check_gpu_fast_path.py                                      # on CPU: CUDA items SKIP

Items: fused kernels (torch.compile'd RMSNorm, LayerNorm, bias-SwiGLU, bias-GeLU, RoPE, vocab-parallel
cross entropy) compiled and matching their plain versions in bf16; SDPA's flash kernel usable by the
attention's causal call; flash-attn importable; and, from a short in-process ``pretrain`` (tiny GPT, bf16,
mock data, --overlap-grad-reduce): bf16 model with fp32 main params, fused AdamW / apex FusedAdam chosen,
gradient accumulation fused into main_grad, the DDP grad-ready hook path, no host-device sync in a
steady-state iteration (torch.cuda.set_sync_debug_mode), CUDA_DEVICE_MAX_CONNECTIONS, CUDA graphs.

This is a tool, not library code, so it calls ``torch.cuda`` directly. Exit status 1 when any item FAILs.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

RESULTS = []


def report(item: str, status: str, reason: str = "") -> None:
    RESULTS.append((item, status))
    print(f"{status:4s}  {item}{': ' + reason if reason else ''}", flush=True)


def check(item: str, needs_cuda: bool = True):
    """Decorator: run the check, turn exceptions into FAIL, SKIP CUDA items without a GPU."""
    def wrap(fn):
        def run(*args):
            if needs_cuda and not torch.cuda.is_available():
                return report(item, "SKIP", "no CUDA device")
            try:
                status, reason = fn(*args)
            except Exception as exc:  # a check that crashes is a failed check, with the reason
                status, reason = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            report(item, status, reason)
        return run
    return wrap


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _compare(fused_call, plain_call, inputs, op_objects, tol=3e-2):
    """Run the fused and the plain version (forward + backward) on copies of ``inputs``."""
    outs, grads = [], []
    for call in (fused_call, plain_call):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = call(*xs)
        upstream = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(3),
                               device=out.device, dtype=out.dtype)
        grads.append(torch.autograd.grad((out * upstream).sum(), [x for x in xs if x.requires_grad]))
        outs.append(out)
    for op in op_objects:
        if op.last_choice != "compiled":
            return "FAIL", f"{op.label}: ran {op.last_choice} ({op._broken or 'not chosen'})"
    err = max([_rel_err(outs[0], outs[1])] + [_rel_err(a, b) for a, b in zip(*grads)])
    return ("PASS" if err <= tol else "FAIL"), f"compiled vs plain bf16, max relative error {err:.2e} (tol {tol})"


def _init_single_rank():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


def check_fused_kernels():
    from megatron.core import parallel_state
    from megatron.core.fusions import fused_kernels as fk
    from megatron.core.fusions.fused_cross_entropy import GRADIENT, LOCAL_STATISTICS, fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron.core.transformer import fusions

    dev, bf16 = torch.device("cuda"), torch.bfloat16

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, device=dev, dtype=dtype)

    freqs = torch.rand(128, 1, 1, 32, device=dev).repeat(1, 1, 1, 2)
    cases = {
        "RMSNorm": (lambda x, w: fk.RMS_NORM(x, w, 1e-6), lambda x, w: fk.rms_norm(x, w, 1e-6),
                    [rnd(128, 2, 1024), rnd(1024)], [fk.RMS_NORM]),
        "LayerNorm": (lambda x, w, b: fk.LAYER_NORM(x, w, b, 1e-5), lambda x, w, b: fk.layer_norm(x, w, b, 1e-5),
                      [rnd(128, 2, 1024), rnd(1024), rnd(1024)], [fk.LAYER_NORM]),
        "bias-SwiGLU": (lambda y, b: fk.BIAS_SWIGLU(y, b), fk.bias_swiglu, [rnd(128, 2, 2048), rnd(2048)],
                        [fk.BIAS_SWIGLU]),
        "RoPE": (lambda t: fk.ROTARY(t, freqs), lambda t: fk.rotary(t, freqs), [rnd(128, 2, 8, 64)], [fk.ROTARY]),
    }
    for name, (fused, plain, inputs, ops) in cases.items():
        check(f"fused {name} compiled on CUDA, bf16 == plain")(lambda f=fused, p=plain, i=inputs, o=ops:
                                                                  _compare(f, p, i, o))()

    @check("fused bias-GeLU compiled on CUDA, bf16 == plain")
    def gelu():
        y, b = rnd(128, 2, 1024), rnd(1024)
        fused = lambda y_, b_: fusions.bias_gelu_impl(y_, b_)  # noqa: E731
        plain = lambda y_, b_: fusions.bias_gelu_impl(y_, b_, use_compiled=False)  # noqa: E731
        status, reason = _compare(fused, plain, [y, b], [])
        blocker = fk.compile_blocker(True)
        return ("FAIL", f"not compiled: {blocker}") if blocker else (status, reason)

    gelu()
    _init_single_rank()
    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)

    @check("fused vocab-parallel cross entropy compiled on CUDA == plain (fp32 logits)")
    def ce():
        logits = rnd(128, 2, 50304, dtype=torch.float32)
        target = torch.randint(0, 50304, (128, 2), device=dev)
        return _compare(lambda z, t: fused_vocab_parallel_cross_entropy(z, t),
                        lambda z, t: vocab_parallel_cross_entropy(z, t), [logits, target],
                        [LOCAL_STATISTICS, GRADIENT], tol=1e-4)

    ce()
    check_sdpa_flash()
    parallel_state.destroy_model_parallel()  # pretrain below sets up its own groups


@check("SDPA flash kernel usable by the causal attention call (no mask, is_causal=True, bf16)")
def check_sdpa_flash():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron.core.transformer.dot_product_attention import CoreAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, bf16=True,
                               attention_dropout=0.0)
    attention = CoreAttention(1, config, AttnMaskType.causal).cuda()
    q, k, v = (torch.randn(256, 2, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # flash only: raises if our call cannot use it
        out = attention(q, k, v, None)
    torch.cuda.synchronize()
    return "PASS", f"CoreAttention ran under sdpa_kernel(FLASH_ATTENTION) only, output {tuple(out.shape)}"


@check("flash-attn package (--use-flash-attn)")
def check_flash_attn():
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "SKIP", "flash-attn not installed (SDPA's flash kernel is used instead)"
    return "PASS", f"flash_attn {getattr(flash_attn, '__version__', '?')} importable"


@check("CUDA_DEVICE_MAX_CONNECTIONS=1 (needed with TP>1 + sequence parallel / async TP all-reduce)")
def check_max_connections():
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value == "1":
        return "PASS", "set to 1"
    return "FAIL", f"is {value!r}: export CUDA_DEVICE_MAX_CONNECTIONS=1 before launching (validate_args requires it)"


@check("CUDA graphs (--enable-cuda-graph)", needs_cuda=False)
def check_cuda_graphs():
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.errors import ConfigurationError

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
            "--enable-cuda-graph"]
    try:
        validate_args(parse_args(argv=argv))
    except ConfigurationError as exc:
        return "SKIP", f"not implemented; the flag errors clearly: {exc}"
    return "FAIL", "--enable-cuda-graph was accepted but nothing captures graphs"


def run_tiny_pretrain():
    """bf16 tiny GPT, mock data, 6 iterations; returns what the training checks need."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.training import training as training_mod

    sys.path.insert(0, REPO)
    import pretrain_gpt

    captured = {"hook_calls": 0, "sync_warnings": None, "forward_calls": 0}
    original_ready = param_and_grad_buffer.ParamAndGradBuffer.register_grad_ready
    original_train = training_mod.train

    def counting_ready(self, param):
        captured["hook_calls"] += 1
        return original_ready(self, param)

    def capturing_train(forward_step_func, model, optimizer, *rest):
        captured["model"], captured["optimizer"] = model, optimizer
        return original_train(forward_step_func, model, optimizer, *rest)

    sync_ctx = {}

    def forward_step(data_iterator, model):
        captured["forward_calls"] += 1
        n = captured["forward_calls"]
        if n == 4 and torch.cuda.is_available():  # iteration 4: steady state (warm-up and first logs done)
            sync_ctx["catch"] = warnings.catch_warnings(record=True)
            sync_ctx["records"] = sync_ctx["catch"].__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        elif n == 5 and "catch" in sync_ctx:
            torch.cuda.set_sync_debug_mode("default")
            sync_ctx["catch"].__exit__(None, None, None)
            captured["sync_warnings"] = [str(w.message).splitlines()[0] for w in sync_ctx["records"]
                                         if "synchroniz" in str(w.message)]
        return pretrain_gpt.forward_step(data_iterator, model)

    gpt2 = os.path.join(REPO, "data", "tokenizers", "gpt2")
    argv = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "6", "--lr", "1e-4", "--bf16", "--clip-grad", "0.0", "--overlap-grad-reduce",
            "--mock-data", "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(gpt2, "vocab.json"),
            "--merge-file", os.path.join(gpt2, "merges.txt")]
    if not torch.cuda.is_available():
        argv += ["--distributed-backend", "gloo"]
    _init_single_rank()
    param_and_grad_buffer.ParamAndGradBuffer.register_grad_ready = counting_ready
    training_mod.train = capturing_train
    old_argv, sys.argv = sys.argv, ["pretrain_gpt.py"] + argv
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            pretrain_gpt.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                                  pretrain_gpt.ModelType.encoder_or_decoder, forward_step, args_defaults={})
    finally:
        sys.argv = old_argv
        param_and_grad_buffer.ParamAndGradBuffer.register_grad_ready = original_ready
        training_mod.train = original_train
    captured["log"] = log.getvalue()
    return captured


def check_training(run):
    on_cuda = torch.cuda.is_available()
    log = run["log"]

    @check("bf16 model parameters with fp32 main parameters", needs_cuda=False)
    def precision():
        model_dtypes = {p.dtype for chunk in run["model"] for p in chunk.parameters()}
        main = {p.dtype for group in run["optimizer"].param_groups for p in group["params"]}
        ok = model_dtypes == {torch.bfloat16} and main == {torch.float32}
        return ("PASS" if ok else "FAIL"), f"model {sorted(map(str, model_dtypes))}, main {sorted(map(str, main))}"

    @check("fused AdamW / apex FusedAdam chosen")
    def adam():
        for name in ("apex.optimizers.FusedAdam", "torch.optim.AdamW(fused=True)"):
            if f"Adam: using {name}" in log:
                return "PASS", name
        return "FAIL", "neither apex FusedAdam nor AdamW(fused=True) was logged"

    @check("gradient accumulation fused into main_grad")
    def grad_accum():
        lines = [line for line in log.splitlines() if "gradient accumulation fusion: using" in line]
        return ("PASS", lines[0].strip("> ")) if lines else ("FAIL", "no 'gradient accumulation fusion' line logged")

    @check("DDP overlap: grad-ready hooks fire during backward (world size 1)", needs_cuda=False)
    def overlap():
        calls = run["hook_calls"]
        return ("PASS" if calls > 0 else "FAIL"), f"{calls} register_grad_ready calls in 6 iterations"

    @check("no host-device sync in a steady-state iteration (torch.cuda.set_sync_debug_mode)")
    def no_sync():
        found = run["sync_warnings"]
        if found is None:
            return "FAIL", "the steady-state iteration was not reached"
        return ("PASS", "no synchronising call") if not found else ("FAIL", f"{len(found)}: {found[:3]}")

    for fn in (precision, adam, grad_accum, overlap, no_sync):
        fn()
    if not on_cuda:
        print("      (pretrain ran on CPU with gloo; the CUDA-only choices above were skipped)")


def main():
    print(f"torch {torch.__version__}, CUDA {'available: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}")
    if torch.cuda.is_available():
        check_fused_kernels()  # and the SDPA check, which needs the process group it sets up
    else:
        report("fused kernels compiled on CUDA, bf16 == plain", "SKIP", "no CUDA device")
        check_sdpa_flash()
    check_flash_attn()
    check_max_connections()
    check_cuda_graphs()

    @check("tiny bf16 pretrain (6 iterations, --overlap-grad-reduce)", needs_cuda=False)
    def pretrain_run():
        RUN.update(run_tiny_pretrain())
        return "PASS", "ran"

    RUN = {}
    pretrain_run()
    if RUN:
        check_training(RUN)
    failed = [item for item, status in RESULTS if status == "FAIL"]
    print(f"\n{len(RESULTS)} checks: {sum(s == 'PASS' for _, s in RESULTS)} PASS, {len(failed)} FAIL, "
          f"{sum(s == 'SKIP' for _, s in RESULTS)} SKIP")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
