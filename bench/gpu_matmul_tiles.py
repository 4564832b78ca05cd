"""The Triton matmul's launch tiles and the GPU backward passes: a host/device profile of the invariant
train step, then an A/B of configurations of the product code (``kernels/triton_matmul.py``,
``kernels/grads.py``).

    OUT=bench python bench/gpu_matmul_tiles.py        # writes $OUT/ab.json

1. ``torch.profiler`` tables of the invariant train step (8 x 256 tokens), sorted by self host time and by
   self device time, for each ``size:dtype`` in ``PROFILES`` (default ``13m:fp32,13m:bf16``; empty: none).
2. For each configuration in :data:`CONFIGS` (the product with one change patched in; ``CONFIGS=a,b``
   picks some): the count of rows whose bits differ from the row computed alone, at batch sizes on both
   sides of the small/large launch bound (must be 0); the 76M model's largest products (2048 x 768 x 2048
   and a 64-row decode one) against ``F.linear``, per call over blocks of 50 back-to-back calls; and the
   invariant/default train step (8 x 256) and decode step (64 sequences) of the 76M model
   (``STEPS_13M=1``: of the 13M model too), fp32 and bf16, alternated, medians.

``SMOKE=1`` runs a one-layer 13M model on the CPU under ``TRITON_INTERPRET=1`` to check the script itself
(its timings mean nothing).
"""

import json
import os
import sys
import time

SMOKE = os.environ.get("SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, "bench")
import torch  # noqa: E402
from invariant_cost import decode_step, train_step  # noqa: E402
from paired import alternated_block_medians, alternated_medians  # noqa: E402

import rlfw.kernels.triton_matmul as tm  # noqa: E402
from rlfw.kernels import grads, triton_norm, triton_ops  # noqa: E402
from rlfw.kernels import triton_config as tc  # noqa: E402
from rlfw.kernels.invariant import InvariantOps  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
OUT = os.environ.get("OUT", "/tmp")
SIZE = "13m" if SMOKE else "76m"
res: dict = {"product": {"small": tc.MM_TILES_SMALL, "large": tc.MM_TILES_LARGE, "k16": tc.MM_BLOCK_K_16}}

CONFIGS = {  # name -> changes against the product (small / large launch tiles, 16-bit K slice, widening)
    "product": {},
    "bf16_widened": {"widen16": True},
    "large_128x256": {"large": tc.MatmulTiles(128, 256, 8, 3)},
    "large_128x128_s4": {"large": tc.MatmulTiles(128, 128, 8, 4)},
    "small_64x64": {"small": tc.MatmulTiles(64, 64, 4, 4)},
    "small_16x64": {"small": tc.MatmulTiles(16, 64, 4, 4)},
    "k16_32": {"k16": 32},
    "recompute_backward": {"recompute": True},  # RMSNorm, log-softmax, attention: the recomputed reference
    "torch_norm_backward": {"torch_norm_backward": True},  # RMSNorm's closed form in torch ops, not fused
    "attention_host_sync": {"attention_host_sync": True},  # the host reads the last position per call
    "torch_attention_backward": {"torch_attention_backward": True},  # the closed form in torch ops
    "previous": {  # all three: stop 38's product
        "torch_norm_backward": True,
        "attention_host_sync": True,
        "torch_attention_backward": True,
    },
}
ORIGINAL = (tc.MM_TILES_SMALL, tc.MM_TILES_LARGE, tm.into_tensor_cores, tm.MM_BLOCK_K_16)
NORM_BACKWARD = triton_norm.rms_norm_backward
TRITON_ATTENTION = triton_ops.attention
ATTENTION_BACKWARD = triton_ops.attention_backward


def _host_synced_attention(q, k_cache, v_cache, q_pos, scale):
    """The Triton attention as stop 38 launched it: the host read the batch's last position (a device
    sync) to bound the KV tiles before each launch."""
    int(q_pos.max())
    return TRITON_ATTENTION(q, k_cache, v_cache, q_pos, scale)


def save():
    with open(os.path.join(OUT, "ab.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def _recompute_grads():
    """The backward passes as they were before ``kernels/grads.py``: the torch reference recomputed under
    autograd (for the A/B)."""
    from rlfw.kernels import attention, norm, softmax
    from rlfw.kernels.autograd import recompute_backward

    return {  # the gradient function the op sets pass (a last argument) is ignored
        "rms_norm": lambda fwd, x, w, eps, *_: recompute_backward(fwd, norm.rms_norm, x, w, eps),
        "log_softmax": lambda fwd, x: recompute_backward(fwd, softmax.log_softmax, x),
        "token_logp": lambda fwd, x, ids: recompute_backward(fwd, softmax.token_logp, x, ids),
        "attention": lambda fwd, *a: recompute_backward(fwd, attention.attention_reference, *a[:5]),
    }


CLOSED_FORM = {name: getattr(grads, name) for name in ("rms_norm", "log_softmax", "token_logp", "attention")}


def patch(change):
    for name, fn in (_recompute_grads() if change.get("recompute") else CLOSED_FORM).items():
        setattr(grads, name, fn)
    small, large, cores, k16 = ORIGINAL
    tc.MM_TILES_SMALL = change.get("small", small)  # tc.matmul_tiles reads these at each call
    tc.MM_TILES_LARGE = change.get("large", large)
    tm.into_tensor_cores = (lambda a, b: False) if change.get("widen16") else cores
    tm.MM_BLOCK_K_16 = change.get("k16", k16)
    fused = not change.get("torch_norm_backward")
    triton_norm.rms_norm_backward = NORM_BACKWARD if fused else grads.rms_norm_grads
    triton_ops.attention = _host_synced_attention if change.get("attention_host_sync") else TRITON_ATTENTION
    torch_attention = change.get("torch_attention_backward")
    triton_ops.attention_backward = grads.attention_grads if torch_attention else ATTENTION_BACKWARD


def model(kernels, dtype, size=SIZE):
    from rollout_vs_peers import hf_config

    from rlfw.model import Transformer
    from rlfw.model.config import args_from_hf_config

    torch.manual_seed(0)
    args = args_from_hf_config(hf_config(size))
    if SMOKE:
        import dataclasses

        args = dataclasses.replace(args, num_layers=1)
    m = Transformer(args, kernels=kernels).to(DEV, dtype)
    if SMOKE and kernels == "invariant":
        m.ops = InvariantOps(backend="triton")
    return m


def invariance(dtype):
    """Rows (over shapes and batch sizes) whose bits differ from the row computed alone."""
    g = torch.Generator().manual_seed(0)
    bad = 0
    most = tc.MM_SMALL_ROWS + 1 if SMOKE else 700
    for n, k in [(48, 64), (2048, 768), (362, 768), (7, 255)]:
        if SMOKE and n > 64:
            continue
        w = torch.randn(n, k, generator=g).to(DEV, dtype)
        x = torch.randn(most, k, generator=g).to(DEV, dtype)
        sizes = (
            (1, tc.MM_SMALL_ROWS + 1) if SMOKE else (1, 3, 64, tc.MM_SMALL_ROWS, tc.MM_SMALL_ROWS + 1, 700)
        )
        for rows in sizes:
            full = tm.linear(x[:rows], w)
            for at in {0, rows // 2, rows - 1}:
                bad += int(not torch.equal(full[at], tm.linear(x[at : at + 1], w)[0]))
    return bad


def gemm_times(dtype, reps):
    out = {}
    for m, k, n in ((32, 64, 64), (64, 64, 64)) if SMOKE else ((2048, 768, 2048), (64, 768, 2048)):
        x = torch.randn(m, k, device=DEV).to(dtype)
        w = torch.randn(n, k, device=DEV).to(dtype)
        t_def, t_inv = alternated_block_medians(
            [lambda x=x, w=w: torch.nn.functional.linear(x, w), lambda x=x, w=w: tm.linear(x, w)],
            reps,
            1 if SMOKE else 50,  # 50 back-to-back calls per timed block
        )
        out[f"{m}x{k}x{n}"] = {
            "default_ms": t_def * 1e3,
            "invariant_ms": t_inv * 1e3,
            "tflops": 2 * m * n * k / t_inv / 1e12,
        }
    return out


def steps(dtype, reps, size=SIZE):
    gen = torch.Generator().manual_seed(0)
    tr = torch.randint(3, 362, (2, 16) if SMOKE else (8, 256), generator=gen).to(DEV)
    dc = torch.randint(3, 362, (4, 8) if SMOKE else (64, 128), generator=gen).to(DEV)
    r = {}
    for name, make, ids in (("train", train_step, tr), ("decode", decode_step, dc)):
        runs = [make(model(kk, dtype, size).train(name == "train"), ids) for kk in ("default", "invariant")]
        t_def, t_inv = alternated_medians(runs, reps)
        r[name] = {"default_ms": t_def * 1e3, "invariant_ms": t_inv * 1e3, "ratio": t_inv / t_def}
    return r


def profile_train(dtype, label, size):
    from torch.profiler import ProfilerActivity, profile

    m = model("invariant", dtype, size).train()
    ids = torch.randint(3, 362, (2, 16) if SMOKE else (8, 256), generator=torch.Generator().manual_seed(0))
    run = train_step(m, ids.to(DEV))
    for _ in range(3):
        run()
    acts = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
    with profile(activities=acts) as p:
        for _ in range(5):
            run()
        if not SMOKE:
            torch.cuda.synchronize()
    ka = p.key_averages()
    res[f"profile_{label}_host"] = ka.table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70
    )
    if not SMOKE:
        res[f"profile_{label}_device"] = ka.table(
            sort_by="self_device_time_total", row_limit=15, max_name_column_width=70
        )


t0 = time.time()
reps = 2 if SMOKE else 12
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
for item in os.environ.get("PROFILES", "13m:fp32,13m:bf16").split(","):
    if not item:
        continue
    size, label = item.split(":")
    size = "13m" if SMOKE else size
    try:
        profile_train(DTYPES[label], f"{size}_{label}", size)
    except Exception as e:  # noqa: BLE001
        res[f"profile_{size}_{label}"] = repr(e)
    save()
    print("profile", item, round(time.time() - t0, 1), flush=True)
names = os.environ.get("CONFIGS", ",".join(CONFIGS)).split(",")
for name in names[:2] if SMOKE else names:
    patch(CONFIGS[name])
    r = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if CONFIGS[name].get("widen16") or "k16" in CONFIGS[name]:
            if dtype == torch.float32:
                continue  # the change only touches 16-bit operands
        try:
            r[label] = {"bad_rows": invariance(dtype), "gemm": gemm_times(dtype, reps), **steps(dtype, reps)}
            if os.environ.get("STEPS_13M"):  # the host-bound size too
                r[label]["13m"] = steps(dtype, reps, "13m")
        except Exception as e:  # noqa: BLE001
            r[label] = repr(e)
    res[name] = r
    save()
    print(name, json.dumps(r), round(time.time() - t0, 1), flush=True)
patch({})
