"""The Triton matmul's tile shape on a GPU: a profile of the invariant train step, then tile shapes A/B.

    OUT=bench CONFIGS="16,32,32,0;64,128,32,0" python bench/gpu_matmul_tiles.py   # writes $OUT/ab.json

On the 13M-parameter model of ``bench/rollout_vs_peers.py``: a ``torch.profiler`` table of the invariant
train step (fp32 and bf16; ``SKIP_PROFILE=1`` leaves it out), then for each tile shape ``BM,BN,BK,NATIVE``
(``NATIVE=1``: bf16 operands into the tensor cores instead of widened to fp32, bf16 only) the count of rows
whose bits differ from the row computed alone (must be 0), a [2048, 512] x [512, 1536] product against
``F.linear``, and the invariant/default train step (8 x 256 tokens) and decode step (64 sequences) times,
alternated, medians. ``SMOKE=1`` runs a one-layer model on the CPU under ``TRITON_INTERPRET=1`` to check the
script itself (its timings mean nothing).
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from invariant_cost import decode_step, train_step  # noqa: E402
from paired import alternated_medians  # noqa: E402

import rlfw.kernels.triton_matmul as tm  # noqa: E402
from rlfw.kernels.invariant import InvariantOps  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
OUT = os.environ.get("OUT", "/tmp")
res: dict = {}


def save():
    with open(os.path.join(OUT, "ab.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def model(kernels, dtype):
    from rollout_vs_peers import hf_config

    from rlfw.model import Transformer
    from rlfw.model.config import args_from_hf_config

    torch.manual_seed(0)
    args = args_from_hf_config(hf_config("13m"))
    if SMOKE:
        import dataclasses

        args = dataclasses.replace(args, num_layers=1)
    m = Transformer(args, kernels=kernels).to(DEV, dtype)
    if SMOKE and kernels == "invariant":
        m.ops = InvariantOps(backend="triton")
    return m


@triton.jit
def _mm_native(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    scm,
    scn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * sam + ks[None, :] * sak,
            mask=(rm[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + ks[:, None] * sbk + rn[None, :] * sbn,
            mask=(ks[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        acc += tl.dot(a, b)
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :] * scn,
        acc.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


ORIG = tm.matmul


def native_bf16(bm, bn, bk):
    def matmul(a, b, out_dtype):
        if a.dtype != torch.bfloat16 or SMOKE:
            return ORIG(a, b, out_dtype)
        m, k = a.shape
        n = b.shape[1]
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _mm_native[grid](
            a,
            b,
            c,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            c.stride(0),
            c.stride(1),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
        )
        return c

    return matmul


def set_tiles(bm, bn, bk, bf16_native=False):
    tm.MM_BLOCK_M, tm.MM_BLOCK_N, tm.MM_BLOCK_K = bm, bn, bk
    tm.matmul = native_bf16(bm, bn, bk) if bf16_native else ORIG
    # linear reads tm.matmul at call time through the module global


def invariance(dtype):
    """Max over shapes of rows whose bits differ from the row alone."""
    g = torch.Generator().manual_seed(0)
    bad = 0
    for n, k in [(48, 64), (1536, 512), (362, 512), (7, 255)]:
        w = torch.randn(n, k, generator=g).to(DEV, dtype)
        x = torch.randn(70 if SMOKE else 257, k, generator=g).to(DEV, dtype)
        if SMOKE and n > 64:
            continue
        for rows in (1, 17) if SMOKE else (1, 3, 16, 65, 257):
            full = tm.linear(x[:rows], w)
            for at in {0, rows // 2, rows - 1}:
                bad += int(not torch.equal(full[at], tm.linear(x[at : at + 1], w)[0]))
    return bad


def gemm_time(dtype, m=2048, k=512, n=1536, reps=20):
    x = torch.randn(m, k, device=DEV).to(dtype)
    w = torch.randn(n, k, device=DEV).to(dtype)
    f_inv = lambda: tm.linear(x, w)  # noqa: E731
    f_def = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    t_def, t_inv = alternated_medians([f_def, f_inv], reps)
    return {
        "default_ms": t_def * 1e3,
        "invariant_ms": t_inv * 1e3,
        "tflops_inv": 2 * m * n * k / t_inv / 1e12,
    }


def steps(dtype, reps):
    gen = torch.Generator().manual_seed(0)
    tr = torch.randint(3, 362, (2, 16) if SMOKE else (8, 256), generator=gen).to(DEV)
    dc = torch.randint(3, 362, (4, 8) if SMOKE else (64, 128), generator=gen).to(DEV)
    r = {}
    for name, make, ids in (("train", train_step, tr), ("decode", decode_step, dc)):
        runs = [make(model(kk, dtype).train(name == "train"), ids) for kk in ("default", "invariant")]
        t_def, t_inv = alternated_medians(runs, reps)
        r[name] = {"default_ms": t_def * 1e3, "invariant_ms": t_inv * 1e3, "ratio": t_inv / t_def}
    return r


def profile_train(dtype, label):
    from torch.profiler import ProfilerActivity, profile

    m = model("invariant", dtype).train()
    ids = torch.randint(
        3, 362, (2, 16) if SMOKE else (8, 256), generator=torch.Generator().manual_seed(0)
    ).to(DEV)
    run = train_step(m, ids)
    for _ in range(3):
        run()
    acts = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
    with profile(activities=acts) as p:
        for _ in range(5):
            run()
        if not SMOKE:
            torch.cuda.synchronize()
    ka = p.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            res[f"profile_{label}"] = ka.table(sort_by=key, row_limit=22, max_name_column_width=60)
            break
        except Exception as e:  # noqa: BLE001
            res[f"profile_{label}_err_{key}"] = repr(e)


t0 = time.time()
reps = 2 if SMOKE else 12
for label, dtype in (
    () if os.environ.get("SKIP_PROFILE") else (("fp32", torch.float32), ("bf16", torch.bfloat16))
):
    try:
        profile_train(dtype, label)
    except Exception as e:  # noqa: BLE001
        res[f"profile_{label}"] = repr(e)
    save()
print("profiles", time.time() - t0, flush=True)
configs = [
    (16, 32, 32, False),
    (64, 64, 32, False),
    (64, 128, 32, False),
    (128, 128, 32, False),
    (64, 64, 32, True),
    (128, 128, 64, True),
]
if os.environ.get("CONFIGS"):
    configs = [tuple(int(v) for v in c.split(",")) for c in os.environ["CONFIGS"].split(";")]
if SMOKE:
    configs = configs[1:2] + configs[4:5]
for bm, bn, bk, nat in configs:
    set_tiles(bm, bn, bk, nat)
    key = f"{bm}x{bn}x{bk}{'_bf16native' if nat else ''}"
    r = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if nat and dtype == torch.float32:
            continue
        try:
            r[label] = {
                "bad_rows": invariance(dtype),
                "gemm": gemm_time(dtype, *((32, 64, 64) if SMOKE else ()), reps=reps),
                **steps(dtype, reps),
            }
        except Exception as e:  # noqa: BLE001
            r[label] = repr(e)
    res[key] = r
    save()
    print(key, json.dumps(r), time.time() - t0, flush=True)
