#!/usr/bin/env python3
"""Golden data written by DeepSpeed itself, for the deepspeed/ module's tests.

Trains a small model a few steps with DeepSpeed (pins in
deepspeed/testdata/golden/PINS) at ZeRO stages 1, 2 and 3, in fp32, bf16 and
fp16, with two ranks on the CPU over gloo, and writes for each run:

  ckpt/latest, ckpt/global_step3/        the checkpoint as save_checkpoint writes it
                                         (less the recovery scripts it copies in)
  ckpt/global_step3_universal/,          ds_to_universal's layout
  ckpt/latest_universal
  zero_to_fp32/model.safetensors         zero_to_fp32's output
  state_step3.safetensors                the engine's own per-parameter state at the
                                         checkpoint: fp32/NAME, exp_avg/NAME,
                                         exp_avg_sq/NAME (gathered by DeepSpeed's
                                         safe_get_full_* API) and param/NAME (the
                                         model-dtype parameters)
  continue_stepN.safetensors             DeepSpeed's continuation, steps 4 and 5:
                                         grad/rankR/NAME (the local gradient each
                                         rank's backward produced, model dtype, loss
                                         scale included) and the state after the step
  golden.json                            the config, names, shapes and the scalars
                                         (steps, loss scale, lr, norms, losses)

and, for cmd/train's model (mlp-z2-fp16: its MLP of -in 4 -hidden 16, W1, b1,
W2, b2, the weights decayed), the same and its DeepSpeed config as
ds_config.json, which cmd/train -deepspeed takes to continue the run.

Usage (the venv as deepspeed/testdata/golden/README.md says):
  DS_ACCELERATOR=cpu /work/venv-ds/bin/python scripts/deepspeed_golden.py deepspeed/testdata/golden
"""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

STAGES = (1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
WORLD = 2
TRAIN_STEPS = 3      # the checkpoint is global_step3
CONTINUE_STEPS = 2   # steps 4 and 5
MICRO_BATCH = 4


def ds_config(stage, dtype):
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-2,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.01,
                # FusedAdam would be JIT-compiled on first use (20+ minutes on 2 cores).
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        # A small initial scale and window so the scaler's state moves within 5 steps.
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2},
    }


def build_model(torch):
    nn = torch.nn

    class Net(nn.Module):
        """398 trainable parameters in 5 tensors (two of 7 elements, odd at W=2), one frozen
        parameter and one persistent buffer."""

        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 24)
            self.fc2 = nn.Linear(24, 7)
            self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 7))
            self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
            self.register_buffer("offset", torch.randn(7))

        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            return self.fc2(h) * self.gain + self.offset + self.frozen.sum()

    return Net()


MLP_IN, MLP_HIDDEN = 4, 16


def build_mlp(torch):
    nn = torch.nn

    class MLP(nn.Module):
        """cmd/train's model: y = W2 . sigmoid(W1 . x + b1) + b2, its tensors named as cmd/train names
        them, W1 (hidden x in), b1, W2 (1 x hidden) and b2, in that order."""

        def __init__(self):
            super().__init__()
            self.W1 = nn.Parameter(torch.randn(MLP_HIDDEN, MLP_IN) * 0.5)
            self.b1 = nn.Parameter(torch.zeros(MLP_HIDDEN))
            self.W2 = nn.Parameter(torch.rand(1, MLP_HIDDEN) * 0.5)
            self.b2 = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return torch.sigmoid(x @ self.W1.t() + self.b1) @ self.W2.t() + self.b2

    return MLP()


MODELS = {"net": build_model, "mlp": build_mlp}


def param_groups(model):
    if hasattr(model, "W1"):
        return [{"params": [model.W1, model.W2], "weight_decay": 0.01}, {"params": [model.b1, model.b2], "weight_decay": 0.0}]
    decay = [model.fc1.weight, model.fc2.weight]
    no_decay = [model.fc1.bias, model.fc2.bias, model.gain]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def batch(torch, step, rank, dtype, kind="net"):
    g = torch.Generator().manual_seed(1000 * step + rank)
    inputs, outputs = (8, 7) if kind == "net" else (MLP_IN, 1)
    x = torch.randn(MICRO_BATCH, inputs, generator=g)
    y = torch.randn(MICRO_BATCH, outputs, generator=g)
    return x.to(dtype), y.to(dtype)


def worker(stage, dtype, out, kind="net"):
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    # The CPU accelerator refuses fp16 unless oneDNN reports fp16 support.
    CPU_Accelerator.is_fp16_supported = lambda self: True
    # The shared-memory allreduce op is JIT-built at init when it is listed as compatible.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234)
    model = MODELS[kind](torch)
    names = {p: n for n, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=ds_config(stage, dtype))
    mdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    grads = {}
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda g, n=names[p]: grads.__setitem__(n, g.detach().clone()))

    def module_params():
        """name -> full model-dtype parameter (gathered at ZeRO-3)."""
        with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
            return {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}

    def full_state():
        opt = engine.optimizer
        if hasattr(opt, "_hp_optimizer_states_linked"):
            # ZeRO-1/2 link the moments to the parameters right after the first group's first
            # step, when the later groups have no state yet, so their moments would not be found.
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        t = {}
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            t["fp32/" + n] = safe_get_full_fp32_param(p).detach().clone().contiguous()
            t["exp_avg/" + n] = safe_get_full_optimizer_state(p, "exp_avg").detach().clone().contiguous()
            t["exp_avg_sq/" + n] = safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone().contiguous()
        for n, v in module_params().items():
            t["param/" + n] = v
        return t

    def scalars():
        opt = engine.optimizer
        s = {
            "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples,
            "lr": [float(x) for x in engine.get_lr()],
            "scheduler_last_batch_iteration": engine.lr_scheduler.last_batch_iteration,
            "adam_step_per_group": [],
        }
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3 empties param_groups between steps
            flats = [[] for _ in opt.optimizer.param_groups]
            for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
                flats[opt.sub_group_to_group_id[i]].append(flat)
        else:
            flats = [group["params"] for group in opt.optimizer.param_groups]
        for group in flats:
            steps = {float(opt.optimizer.state[p]["step"]) for p in group if "step" in opt.optimizer.state[p]}
            s["adam_step_per_group"].append(sorted(steps))
        ls = getattr(opt, "loss_scaler", None)
        if ls is not None:
            s["loss_scale"] = float(ls.cur_scale)
            for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
                if hasattr(ls, k):
                    s["loss_scaler_" + k] = getattr(ls, k)
        return s

    def train_step(step):
        grads.clear()
        x, y = batch(torch, step, rank, mdtype, kind)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        loss = loss.detach()
        local = dict(grads)
        scale = float(engine.optimizer.loss_scaler.cur_scale) if hasattr(engine.optimizer, "loss_scaler") else 1.0
        engine.step()
        norm = engine.get_global_grad_norm()
        return float(loss), local, scale, None if norm is None else float(norm)

    log = {"train": []}
    for step in range(1, TRAIN_STEPS + 1):
        loss, _, scale, norm = train_step(step)
        log["train"].append({"step": step, "loss": loss, "loss_scale_used": scale, "grad_norm": norm, **scalars()})

    ckpt = os.path.join(out, "ckpt")
    engine.save_checkpoint(ckpt)
    state = full_state()
    log["checkpoint"] = scalars()
    if rank == 0:
        save_file(state, os.path.join(out, "state_step%d.safetensors" % TRAIN_STEPS))

    log["continue"] = []
    for step in range(TRAIN_STEPS + 1, TRAIN_STEPS + CONTINUE_STEPS + 1):
        loss, local, scale, norm = train_step(step)
        gathered = [None] * WORLD
        torch.distributed.all_gather_object(gathered, {n: g.contiguous() for n, g in local.items()})
        state = full_state()
        losses = [None] * WORLD
        torch.distributed.all_gather_object(losses, loss)
        log["continue"].append({"step": step, "loss_per_rank": losses, "loss_scale_used": scale,
                                "grad_norm": norm, **scalars()})
        if rank == 0:
            for r, g in enumerate(gathered):
                for n, v in g.items():
                    state["grad/rank%d/%s" % (r, n)] = v
            save_file(state, os.path.join(out, "continue_step%d.safetensors" % step))

    if rank == 0:
        meta = {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "stage": stage,
            "dtype": dtype,
            "world_size": WORLD,
            "config": ds_config(stage, dtype),
            "params": [{"name": n, "shape": list(getattr(p, "ds_shape", p.shape)), "trainable": p.requires_grad}
                       for n, p in model.named_parameters()],
            "param_groups": [[names[p] for p in g["params"]] for g in param_groups(model)],
            "batch": "torch.Generator().manual_seed(1000*step + rank): x = randn(4, %d), y = randn(4, %d); "
                     "loss = mse_loss(model(x), y)" % ((8, 7) if kind == "net" else (MLP_IN, 1)),
            **log,
        }
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.write("\n")
        if kind == "mlp":
            with open(os.path.join(out, "ds_config.json"), "w") as f:
                json.dump(ds_config(stage, dtype), f, indent=1, sort_keys=True)
                f.write("\n")
    torch.distributed.barrier()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(stage, dtype, root, kind="net"):
    out = os.path.join(root, ("z%d-%s" if kind == "net" else "mlp-z%d-%s") % (stage, dtype))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        log = open(os.path.join(root, ".log-z%d-%s-rank%d" % (stage, dtype, rank)), "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(stage), dtype, out, kind], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        sys.exit("z%d-%s: workers exited %s (logs in %s/.log-*)" % (stage, dtype, codes, root))

    ckpt = os.path.join(out, "ckpt")
    tag = open(os.path.join(ckpt, "latest")).read().strip()
    # The checkpoint directory also holds copies of DeepSpeed's recovery scripts: not data.
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        path = os.path.join(ckpt, script)
        if os.path.exists(path):
            os.remove(path)

    env = dict(os.environ, DS_ACCELERATOR="cpu")
    subprocess.run([sys.executable, "-c",
                    "import sys; from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
                    "c(sys.argv[1], sys.argv[2], max_shard_size=None, safe_serialization=True)",
                    ckpt, os.path.join(out, "zero_to_fp32")], env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(ckpt, tag), "--output_folder", os.path.join(ckpt, tag + "_universal"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                   env=env, check=True, stdout=subprocess.DEVNULL)


def digest(root):
    lines = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            if rel in ("SHA256SUMS", "README.md") or f.startswith(".log-"):
                continue
            with open(path, "rb") as fh:
                lines.append("%s  %s\n" % (hashlib.sha256(fh.read()).hexdigest(), rel))
    with open(os.path.join(root, "SHA256SUMS"), "w") as f:
        f.writelines(sorted(lines, key=lambda l: l[66:]))


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
        return
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    only = sys.argv[2:]  # optional run names, e.g. z2-bf16
    os.makedirs(root, exist_ok=True)
    runs = [(stage, dtype, "net") for stage in STAGES for dtype in DTYPES] + [(2, "fp16", "mlp")]
    for stage, dtype, kind in runs:
        name = ("z%d-%s" if kind == "net" else "mlp-z%d-%s") % (stage, dtype)
        if only and name not in only:
            continue
        print(name, flush=True)
        run(stage, dtype, root, kind)
    pins = subprocess.run([sys.executable, "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout
    with open(os.path.join(root, "PINS"), "w") as f:
        f.write("# python %s\n" % sys.version.split()[0])
        f.write(pins)
    for f in os.listdir(root):
        if f.startswith(".log-"):
            os.remove(os.path.join(root, f))
    digest(root)


if __name__ == "__main__":
    main()
