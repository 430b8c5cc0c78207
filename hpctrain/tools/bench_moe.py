"""`hpctrain bench moe`: an MoE layer's training throughput with grouped GEMM (torch._grouped_mm) against the
per-expert loop, measured alternately in the same process, and the all-to-all bytes expert parallelism moves.

One MoE layer (--dim, --hidden, --experts, --top-k) forward and backward over --tokens tokens, with the load-balancing
loss on; tokens/s is the median of --repeats runs of each implementation. The all-to-all line routes the same
tokens as --ep ranks would (each its share of the batch) and counts the routed copies that leave their rank —
dispatched and combined, forward and backward — against the planner's even-load estimate
(hpctrain.parallel.experts.all_to_all_bytes). Whatever is measured is reported.
"""

from __future__ import annotations

import statistics
import time

import torch

from hpctrain.core.argparser import Parser, at_least
from hpctrain.core.host import usable_cpus


def _layer(a):
    from hpctrain.core.config import MoEDims
    from hpctrain.models.moe import MoE

    torch.manual_seed(0)
    layer = MoE(a.dim, a.hidden, MoEDims(num_experts=a.experts, top_k=a.top_k, aux_loss_coef=0.01)).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    return layer


def _seconds(layer, x: torch.Tensor, grouped: bool) -> float:
    layer.experts.grouped = grouped
    t0 = time.perf_counter()
    layer(x).square().mean().backward()
    layer.zero_grad(set_to_none=True)
    layer.reset_stats()
    return time.perf_counter() - t0


def _exchanged(layer, x: torch.Tensor, ep: int) -> float:
    """Bytes per device per step the routing of `x` sends off-rank when `ep` ranks each hold a share of the tokens
    and of the experts (dispatch + combine, forward + backward), the mean over the ranks."""
    local = layer.num_experts // ep
    sent = 0
    with torch.no_grad():
        for rank, share in enumerate(x.chunk(ep)):
            _, chosen, _, _ = layer.router(share.reshape(-1, share.shape[-1]))
            sent += int((chosen // local != rank).sum())
    return sent / ep * x.shape[-1] * x.element_size() * 2 * 2


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog="hpctrain bench moe", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=at_least(1), default=256)
    p.add_argument("--hidden", type=at_least(1), default=512, help="each expert's hidden width")
    p.add_argument("--experts", type=at_least(1), default=8)
    p.add_argument("--top-k", type=at_least(1), default=2)
    p.add_argument("--tokens", type=at_least(1), default=4096)
    p.add_argument("--ep", type=at_least(1), default=2, help="ranks the experts are shared out over (the all-to-all line)")
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--threads", type=at_least(1), default=usable_cpus())
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.top_k > a.experts or a.experts % a.ep:
        p.error(f"--top-k {a.top_k} must be at most --experts {a.experts}, and --ep {a.ep} must divide them")
    from hpctrain.core.config import MoEDims
    from hpctrain.models.moe import grouped_mm_works
    from hpctrain.parallel.experts import all_to_all_bytes

    torch.set_num_threads(a.threads)
    layer = _layer(a)
    x = torch.randn(a.tokens // 256 or 1, min(256, a.tokens), a.dim, generator=torch.Generator().manual_seed(1))
    usable = grouped_mm_works(x.reshape(-1, a.dim), layer.experts.w1, layer.experts.w2)
    times = {"grouped GEMM": [], "loop": []}
    _seconds(layer, x, True)  # (warm-up: first-call allocations)
    for rep in range(a.repeats):
        for name in (("grouped GEMM", "loop") if rep % 2 == 0 else ("loop", "grouped GEMM")):
            times[name].append(_seconds(layer, x, name == "grouped GEMM"))
    tokens = x.shape[0] * x.shape[1]
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    print(f"\n{'experts':13} | {'tokens/s':>10} | vs loop\n" + "-" * 40)
    for name, rate in rates.items():
        print(f"{name:13} | {rate:10.0f} | {rate / rates['loop']:.2f}×")
    moe = MoEDims(num_experts=a.experts, top_k=a.top_k)
    measured = _exchanged(layer, x, a.ep)
    estimate = all_to_all_bytes(moe, [0], a.dim, tokens // a.ep, a.ep, x.element_size(), recomputed=False)
    print(f"one MoE layer fwd+bwd: dim {a.dim}, {a.experts} experts of {a.hidden}, top-{a.top_k}, {tokens} tokens, "
          f"fp32, {a.threads} threads, median of {a.repeats}; grouped GEMM {'used' if usable else 'NOT usable here'}")
    print(f"all-to-all at ep={a.ep}: {measured / 1e6:.2f} MB sent per device per layer and step (this routing) vs "
          f"{estimate / 1e6:.2f} MB at even load (the planner's)")
    doc = {"rates": rates, "times_s": times, "a2a_bytes": measured, "a2a_estimate": estimate, "settings": vars(a)}
    if a.json:
        from hpctrain.core.files import write_json

        write_json(a.json, doc)
    return doc


if __name__ == "__main__":
    main()
