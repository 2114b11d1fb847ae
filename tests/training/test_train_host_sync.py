"""No host-device synchronisation in the steady-state training loop.

Every way a tensor becomes a Python value (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``float()``,
``int()``, ``bool()``, ``torch.equal``, printing) waits for the GPU. On CPU nothing waits, but the same code
runs, so counting those calls during non-log iterations of a real ``pretrain`` loop catches every sync the
loop would make on a GPU. Reading the batch (``next(data_iterator)``: the data loader works on host memory)
is not counted.

Documented bounds per iteration (everything else is 0):
* fp32/bf16 without gradient clipping (``--clip-grad 0``) and without result checks
  (``--no-check-for-nan-in-loss-and-grad``): 0;
* with clipping (``--clip-grad 1.0``, Megatron's default): 1, the global grad norm that decides the clipping
  coefficient (``get_grad_norm_fp32`` returns a number, as in Megatron);
* fp16: + 1, the found-inf flag that decides whether the step is skipped (Megatron syncs there too);
* with the NaN / Inf checks of the rerun state machine (on by default, as in Megatron): + 1, its verdict on the
  iteration's losses and gradients, read once per iteration (Megatron reads each check as it happens). With more
  than one rank that read is the machine's agreement all-reduce, which also runs without checks (as Megatron's)
  unless ``--rerun-mode disabled``.
"""
import functools
import traceback

import torch

from helpers.dist_harness import run_distributed
from helpers.args_test_helpers import clean_env  # noqa: F401  (fixture)
from helpers.train_helpers import load_entry_point

SYNC_METHODS = ["item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__repr__", "__format__"]


class SyncCounter:
    def __init__(self):
        self.active = False
        self.paused = 0
        self.sites = []

    def record(self, name):
        if self.active and not self.paused:
            frame = traceback.extract_stack(limit=4)[-3]
            self.sites.append(f"{name} at {frame.filename.split('/megatron-')[-1]}:{frame.lineno}")

    def install(self):
        originals = {}
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            originals[name] = original

            def wrapper(self_, *args, __name=name, __original=original, **kwargs):
                counter.record(f"Tensor.{__name}")
                return __original(self_, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        original_equal = torch.equal
        originals["equal"] = original_equal

        def equal(*args, **kwargs):
            counter.record("torch.equal")
            return original_equal(*args, **kwargs)

        torch.equal = equal
        counter = self
        return originals

    @staticmethod
    def uninstall(originals):
        torch.equal = originals.pop("equal")
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class _PausingIterator:
    """Reading a batch is host work (data loader): not counted."""

    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter

    def __iter__(self):
        return self

    def __next__(self):
        self.counter.paused += 1
        try:
            return next(self.inner)
        finally:
            self.counter.paused -= 1


def count_syncs_body(runs, iters):
    import sys

    from megatron.core import parallel_state as ps
    from megatron.training import global_vars
    from helpers.train_helpers import GPT_ARGS

    module = load_entry_point("pretrain_gpt")
    results = {}
    for name, extra in runs:
        counter = SyncCounter()
        marks = []  # sync count at the start of each iteration's forward step

        def forward_step(data_iterator, model):
            marks.append(len(counter.sites))
            counter.active = True
            it = _PausingIterator(data_iterator, counter) if data_iterator is not None else None
            return module.forward_step(it, model)

        args = GPT_ARGS + ["--mock-data", "--num-layers", "2", "--global-batch-size", "1", "--train-iters", str(iters),
                           "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "0"] + extra
        originals = counter.install()
        argv, sys.argv = sys.argv, ["pretrain_gpt.py"] + args
        try:
            module.pretrain(module.train_valid_test_datasets_provider, module.model_provider,
                            module.ModelType.encoder_or_decoder, forward_step, args_defaults={})
        finally:
            counter.active = False
            sys.argv = argv
            SyncCounter.uninstall(originals)
            global_vars.destroy_global_vars()
            ps.destroy_model_parallel()
        # Iteration i spans forward_step i to forward_step i + 1; skip the first (warm-up, first-call logs).
        per_iter = [marks[i + 1] - marks[i] for i in range(1, len(marks) - 1)]
        sites = sorted(set(counter.sites[marks[1]:marks[-1]]))
        results[name] = (per_iter, sites)
    return results


def test_steady_state_iterations_do_not_sync_host_and_device():
    runs = [("fp32, no clipping, no checks", ["--clip-grad", "0.0", "--no-check-for-nan-in-loss-and-grad"]),
            ("bf16, clipping", ["--bf16", "--clip-grad", "1.0"]),
            ("fp16, clipping", ["--fp16", "--clip-grad", "1.0", "--initial-loss-scale", "1024"])]
    (results,) = run_distributed(count_syncs_body, 1, runs, 6, timeout=300)
    print("host-device syncs per steady-state iteration:", results)
    expected = {"fp32, no clipping, no checks": 0, "bf16, clipping": 2, "fp16, clipping": 3}
    for name, (per_iter, sites) in results.items():
        assert len(per_iter) >= 3, (name, per_iter)
        assert max(per_iter) <= expected[name], (name, per_iter, sites)
    fp16_sites = " ".join(results["fp16, clipping"][1])
    assert "clip_grads.py" in fp16_sites and "optimizer.py" in fp16_sites, fp16_sites


def test_cuda_graph_flags_are_performance_only(clean_env, capsys):
    """CUDA graphs are not captured: the flags are accepted and the log says once that the layers run eagerly."""
    from helpers.args_test_helpers import validated

    for flag in ("--enable-cuda-graph", "--external-cuda-graph"):
        assert getattr(validated(flag, world_size=1), flag[2:].replace("-", "_"))
        out = capsys.readouterr().out
        assert out.count(f"{flag}: performance only here; CUDA graphs are not captured") == 1, out
    assert not validated("", world_size=1).enable_cuda_graph  # off by default
