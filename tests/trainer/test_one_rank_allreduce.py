"""One trainer rank at ZeRO stage 0 skips DeepSpeed's gradient all-reduce, and its steps keep their bits.

The all-reduce over one rank flattens every gradient, reduces it alone, divides it by 1 and copies it back.
The pass also gives zeros to a parameter without a gradient (an MoE expert no token reached), and AdamW
steps such a parameter (momentum, weight decay) where it skips one whose gradient is ``None``; the
backend does that part itself. If skipping the pass ever changed a bit (that part forgotten, or a
DeepSpeed version whose pass also scales or casts), the parameters after two steps of two micro-batches,
the second with one weight left without a gradient, would differ here from the same steps with the pass
on. From stage 1 up the optimizer reads its partitions from that pass, so it must stay on there.
"""

from __future__ import annotations

from tests.trainer.one_rank import run_one_rank

SCRIPT = """
ids = torch.randint(4, 90, (4, 12), generator=torch.Generator().manual_seed(0))

def train(stage, precision, allreduce):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = build_preset("tiny_dense", seed=0, dtype=dtype).train()
    backend = DeepSpeedBackend(model, OptimConfig(1e-3, 0.1, 1.0, 0, "constant", 10, stage, precision))
    chosen = backend.engine.enable_backward_allreduce
    if allreduce is not None:
        backend.engine.enable_backward_allreduce = allreduce
    idle = model.model.layers[0].mlp.up_proj.weight  # as an expert no token reached: no gradient
    norms = []
    for step in range(2):
        for mb in ids.split(2):
            backend.backward(backend.module(mb).float().logsumexp(-1).mean())
        if step == 1:
            idle.grad = None
        norms.append(backend.step())
    bits = [p.detach().float().view(torch.int32).clone() for p in model.parameters()]
    return chosen, norms, bits

out = {}
for precision in ("fp32", "bf16"):
    chosen, norms, bits = train(0, precision, None)
    _, norms_on, bits_on = train(0, precision, True)
    out[precision] = {
        "allreduce": chosen,
        "same_params": all(torch.equal(a, b) for a, b in zip(bits, bits_on)),
        "same_norms": norms == norms_on,
    }
out["stage1"] = {"allreduce": train(1, "fp32", None)[0]}
print(json.dumps(out))
"""


def test_one_rank_at_stage_0_skips_the_all_reduce_with_the_same_bits() -> None:
    got = run_one_rank(SCRIPT)
    for precision in ("fp32", "bf16"):
        assert got[precision] == {"allreduce": False, "same_params": True, "same_norms": True}, precision
    assert got["stage1"] == {"allreduce": True}
