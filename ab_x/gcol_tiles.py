# Tile A/B of the per-group column kernel (GB/s of 3 bytes per element), same bits checked.
import torch, triton
from fp8tensor.numerics import kernels
from fp8tensor import grouped as G
torch.manual_seed(0)
base = dict(kernels.GROUP_COL_CONFIG)
cands = [(128, 32, 4), (64, 32, 4), (128, 16, 4), (64, 16, 2), (256, 32, 8), (128, 64, 4), (64, 64, 4), (32, 32, 2)]
for name, M, C, E in [("C2048 E8", 16384, 2048, 8), ("C4096 E8", 16384, 4096, 8), ("C7168 E8", 16384, 7168, 8),
                      ("C768 E128", 65536, 768, 128), ("C2048 E128", 65536, 2048, 128)]:
    p = torch.distributions.Dirichlet(torch.ones(E)).sample()
    sizes = (p * M).floor().long(); sizes[0] += M - sizes.sum()
    offs = torch.cumsum(sizes, 0).to(torch.int32).cuda()
    x = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
    M_pad, pad_ends, pad_starts = G.padded_offsets(offs, M)
    ref = None
    line = []
    for bm, bc, w in cands:
        kernels.GROUP_COL_CONFIG = kernels._frozen({**base, "block_m": bm, "block_c": bc, "warps": w})
        try:
            q, s = G.quantize_group_cols(x, offs, M_pad, pad_starts)
            end = int(pad_ends[-1])
            if ref is None:
                ref = (q[:, :end].view(torch.uint8).clone(), s.clone())
            else:
                assert torch.equal(ref[0], q[:, :end].view(torch.uint8)) and torch.equal(ref[1], s)
            ms = triton.testing.do_bench(lambda: G.quantize_group_cols(x, offs, M_pad, pad_starts), warmup=10, rep=40)
            line.append(f"({bm},{bc},{w}) {ms*1e3:.0f}us {M*C*3/ms/1e6:.0f}GB/s")
        except Exception as e:
            line.append(f"({bm},{bc},{w}) {type(e).__name__}")
    print(name, " | ".join(line), flush=True)
kernels.GROUP_COL_CONFIG = kernels._frozen(base)
print("tiles ok")
