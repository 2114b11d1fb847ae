"""Multi-rank jobs of pretrain_gpt.py for the reliability tests: plain processes with RANK/WORLD_SIZE/MASTER_* in
one process group (as a SLURM job step starts them) or one torchrun, each with its output in a log file."""
import os
import random
import re
import signal
import subprocess
import sys
import time

from helpers.dist_harness import free_port
from helpers.train_helpers import GPT_ARGS, REPO


class Job:
    """N ranks of pretrain_gpt.py, either as plain processes in one process group or under torchrun."""

    def __init__(self, tmp, data_path, nranks, extra=(), env=None, torchrun=False, base=(), torchrun_args=()):
        self.logs = []
        base_env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_FORCE_CPU="1", OMP_NUM_THREADS="1")
        base_env.pop("MEGATRON_FAULT_INJECT", None)
        base_env.update(env or {})
        argv = [os.path.join(REPO, "pretrain_gpt.py"), *GPT_ARGS, "--data-path", data_path, *base, *extra]
        port = str(free_port())
        if torchrun:
            log = open(os.path.join(tmp, "torchrun.log"), "w+")
            self.logs.append(log)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nranks),
                   *(() if "--standalone" in torchrun_args else ("--master-addr", "127.0.0.1", "--master-port", port)),
                   *torchrun_args, *argv]
            self.procs = [subprocess.Popen(cmd, env=base_env, stdout=log, stderr=subprocess.STDOUT,
                                           process_group=0)]
        else:
            self.procs = []
            for rank in range(nranks):
                log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
                self.logs.append(log)
                env_r = dict(base_env, RANK=str(rank), WORLD_SIZE=str(nranks), LOCAL_RANK=str(rank),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                group = 0 if rank == 0 else self.procs[0].pid  # one process group, like a SLURM job step
                self.procs.append(subprocess.Popen([sys.executable, *argv], env=env_r, stdout=log,
                                                   stderr=subprocess.STDOUT, process_group=group))
        self.pgid = self.procs[0].pid
        self.start = time.time()

    def output(self, i=None):
        logs = self.logs if i is None else [self.logs[i]]
        text = ""
        for log in logs:
            log.flush()
            with open(log.name) as f:
                text += f.read()
        return text

    def wait_for(self, pattern, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if re.search(pattern, self.output()):
                return
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} never appeared:\n{self.output()[-4000:]}")

    def wait(self, timeout):
        """Exit codes and seconds since ``self.start`` each process took; kills everything on a hang."""
        deadline = time.time() + timeout
        ended = {}
        while len(ended) < len(self.procs) and time.time() < deadline:
            for i, p in enumerate(self.procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time() - self.start
            time.sleep(0.1)
        if len(ended) < len(self.procs):
            self.kill()
            raise AssertionError(f"ranks {sorted(set(range(len(self.procs))) - set(ended))} hung:\n"
                                 f"{self.output()[-6000:]}")
        return [p.returncode for p in self.procs], [ended[i] for i in range(len(self.procs))]

    def kill(self):
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.procs:
            p.wait(timeout=30)

    def assert_no_process_left(self):
        """Nothing in the job's process group survives (torchrun's workers included)."""
        time.sleep(0.5)
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.pgid and fields[0] not in ("Z", "X"):
                    left.append(int(entry))
        if left:
            self.kill()
        assert not left, f"processes {left} of the job are still running"


def logged_losses(text):
    """{iteration: lm loss} from the iteration log lines of ``text`` (the last line of an iteration wins)."""
    found = re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", text)
    return {int(it): float(loss) for it, loss in found}


def first_injection(rate, world, calls_per_iteration, seed=1234):
    """(iteration, ranks) of the rerun state machine's first injected error (``--error-injection-rate rate``, GPT_ARGS'
    ``--seed``): each validation call draws ``randint(0, rate - 1)`` from one stream seeded alike on every rank, and
    rank ``r`` injects when ``(draw + r) % rate == 0`` (the formula, written here independently of the library)."""
    rng = random.Random(seed)
    for call in range(10000):
        drawn = rng.randint(0, rate - 1)
        ranks = [r for r in range(world) if (drawn + r) % rate == 0]
        if ranks:
            return call // calls_per_iteration + 1, ranks
    return None, []


def rate_for(world, calls_per_iteration, iteration, rank=None):
    """The smallest rate whose first injection lands in ``iteration`` (on ``rank`` alone, when given)."""
    for rate in range(2, 2000):
        it, ranks = first_injection(rate, world, calls_per_iteration)
        if it == iteration and (rank is None or ranks == [rank]):
            return rate
    raise AssertionError("no rate found")
