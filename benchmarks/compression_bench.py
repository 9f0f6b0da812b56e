"""Encode/decode throughput of every p2ptrain.compression codec, in GB/s of float32 input.

A ``--numel`` float32 tensor (default 64M values = 256 MB, gradient-like: randn with a few
outliers) is processed in ``--chunk`` value chunks (default 1M = 4 MB, what the all-reduce sends),
as the all-reduce would: encode every chunk; decode every received chunk into a preallocated output
slice (``decode``) or add it into a float32 accumulator (``decode_add``). Baselines in the same
run: a chunked ``clone`` (memcpy) and a chunked ``acc.add_`` (what an uncompressed reduction costs).
Best of ``--repeat`` passes. ``--device cuda`` keeps the input, outputs and accumulator on the GPU:
encode then includes the copy of the (compressed) wire bytes to the host, decode the copy back, as
in a round with a model on the GPU; the baseline rows are then the host-bound copy of the fp32
chunk (what ``none`` costs at least) and a device ``add_``. ``--device-path`` adds a row per codec
with a device path (``Codec.devices``) that calls ``device_encode`` (into two reused host buffers,
pinned on CUDA, as a sender takes turns with them), ``device_decode`` and ``device_decode_add``: on
the CPU, the torch ops a GPU runs against the compiled kernels in the same run.

    python benchmarks/compression_bench.py [--numel N] [--chunk N] [--threads T] [--device cuda] [--device-path]
                                           [--json out.json]
    python benchmarks/compression_bench.py --quality

``--quality`` prints each codec's relative L2 error ``|dec - x| / |x|`` instead, on tensors of
different tails: Gaussian, Student-t (3 degrees of freedom), Gaussian with 0.2% of the values
x100, and real updates of the example tasks (the first gradient of ``digits`` and ``char_lm``, and
``char_lm``'s DiLoCo pseudo-gradient after 50 AdamW steps), with their kurtosis, and the ratio of
``int8``'s error to ``int8-outlier``'s.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from p2ptrain.compression import CODECS, Encoded, get_codec, iter_chunks, kernels
from p2ptrain.compression.device import host_buffer


def wire_copy(enc: Encoded) -> tuple[dict, list[bytes]]:
    """An encoded chunk's meta and a copy of its bytes (its buffer is about to be reused)."""
    return enc.meta, [enc.tobytes()]


def best_time(fn, repeat: int, device: torch.device = torch.device("cpu")) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up (allocator, lazy init)
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()  # a GPU's queued kernels count
        best = min(best, time.perf_counter() - t0)
    return best


def _task_updates() -> list[tuple[str, torch.Tensor]]:
    """The first gradient of each example task, and char_lm's pseudo-gradient after 50 steps."""
    from p2ptrain.tasks import get_task

    out = []
    for name in ("digits", "char_lm"):
        task = get_task(name)
        torch.manual_seed(0)
        model = task.make_model(seed=0)
        opt = task.make_optimizer(model.parameters())
        start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        for step, batch in zip(range(50), task.batches(32, seed=0)):
            opt.zero_grad()
            task.loss(model, batch).backward()
            if step == 0:
                out.append((f"{name} gradient", torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
            opt.step()
        if name == "char_lm":
            out.append((f"{name} pseudo-gradient",
                        start - torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    return out


def quality(codecs: list[str]) -> None:
    torch.manual_seed(0)  # (the Student-t sampler draws from the global generator)
    g = torch.Generator().manual_seed(0)
    n = 1 << 22
    spiky = torch.randn(n, generator=g)
    spiky[torch.randint(0, n, (n // 500,), generator=g)] *= 100
    inputs = [("gaussian", torch.randn(n, generator=g)),
              ("student-t, 3 dof", torch.distributions.StudentT(3.0).sample((n,))),
              ("gaussian, 0.2% x100", spiky), *_task_updates()]
    codecs = [c for c in codecs if c != "topk"]  # (sparse: its error is what it drops, not a rounding)
    print(f"{'relative L2 error':<26}{'kurtosis':>9}" + "".join(f"{c:>14}" for c in codecs)
          + ("  int8 / int8-outlier" if {"int8", "int8-outlier"} <= set(codecs) else ""))
    for label, x in inputs:
        x = x.float().contiguous()
        kurt = float(((x - x.mean()) ** 4).mean() / x.var() ** 2)
        errs = {}
        for name in codecs:
            codec = get_codec(name)
            dec = torch.empty_like(x)
            for c, o in zip(iter_chunks(x), iter_chunks(dec)):
                enc = codec.encode(c)
                codec.decode(enc.meta, enc.tobytes(), out=o)
            errs[name] = float((dec - x).norm() / x.norm())
        ratio = f"{errs['int8'] / errs['int8-outlier']:>20.1f}x" if {"int8", "int8-outlier"} <= set(errs) else ""
        print(f"{label:<26}{kurt:>9.1f}" + "".join(f"{errs[c]:>14.2e}" for c in codecs) + ratio)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=64 << 20)
    ap.add_argument("--chunk", type=int, default=1 << 20)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec names")
    ap.add_argument("--int8-blocks", default="", help="also bench int8 with these block sizes, e.g. 64,128")
    ap.add_argument("--topk-fraction", type=float, default=0.01)
    ap.add_argument("--device", default="cpu", help="where the tensors live: cpu (default) or cuda")
    ap.add_argument("--device-path", action="store_true",
                    help="also time each codec's device path (device_encode / device_decode / device_decode_add)")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--quality", action="store_true", help="print each codec's error on differently tailed "
                    "tensors and real task updates instead of throughput")
    args = ap.parse_args(argv)
    if args.quality:
        return quality([n for n in args.codecs.split(",") if n])
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    gb = args.numel * 4 / 1e9
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads={threads}, "
          f"numel={args.numel} ({gb * 1e3:.0f} MB fp32), chunk={args.chunk} ({args.chunk * 4 / 1e6:.1f} MB), "
          f"best of {args.repeat}, device={device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f"; int8 kernels: {'on' if kernels.AVAILABLE else 'off'} (P2PT_KERNELS=0 for the torch path)")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=g)
    x[torch.randint(0, args.numel, (args.numel // 10000,), generator=g)] *= 50  # outliers
    x = x.to(device)
    chunks = list(iter_chunks(x, args.chunk))
    out = torch.empty_like(x)
    out_chunks = list(iter_chunks(out, args.chunk))
    acc = torch.zeros_like(x)
    acc_chunks = list(iter_chunks(acc, args.chunk))

    rows = []

    def row(name, enc_s, dec_s, add_s, ratio, max_err, mean_err):
        r = dict(codec=name, encode_GBps=gb / enc_s if enc_s else None, decode_GBps=gb / dec_s if dec_s else None,
                 decode_add_GBps=gb / add_s if add_s else None, ratio=ratio, max_abs_err=max_err,
                 mean_abs_err=mean_err)
        rows.append(r)
        return r

    # baselines
    if device.type == "cuda":
        t_clone = best_time(lambda: [c.to("cpu") for c in chunks], args.repeat, device)
        label = "copy to host"
    else:
        t_clone = best_time(lambda: [c.clone() for c in chunks], args.repeat)
        label = "memcpy (clone)"
    t_add = best_time(lambda: [a.add_(c) for a, c in zip(acc_chunks, chunks)], args.repeat, device)
    row(label, t_clone, t_clone, t_add, 1.0, 0.0, 0.0)

    specs = [(n, {}) for n in args.codecs.split(",") if n]
    specs = [(n, {"fraction": args.topk_fraction}) if n == "topk" else (n, o) for n, o in specs]
    specs += [("int8", {"block": int(b)}) for b in args.int8_blocks.split(",") if b]
    specs = [(n, o, False) for n, o in specs]
    if args.device_path:
        specs += [(n, o, True) for n, o, _ in specs if device.type in get_codec(n, **o).devices]
    for name, opts, staged in specs:
        label = name + "".join(f" {k}={v}" for k, v in opts.items()) + (" (device path)" if staged else "")
        codec = get_codec(name, **opts)
        encs = []
        stage = [host_buffer(codec.encoded_nbytes(args.chunk)) for _ in range(2)] if staged else []

        def encode_all():
            encs.clear()
            if name == "topk":
                codec.reset()
            for i, c in enumerate(chunks):
                if staged:  # (its bytes must be used before the buffer's next turn: here, kept as a copy)
                    encs.append(Encoded(*wire_copy(codec.device_encode(c, out=stage[i % 2]))))
                else:
                    encs.append(codec.encode(c, key=i))

        t_enc = best_time(encode_all, args.repeat, device)
        # what the receiver holds: one contiguous buffer per chunk
        wires = [bytearray(e.tobytes()) for e in encs]
        metas = [e.meta for e in encs]
        wire_bytes = sum(len(w) for w in wires)
        decode = codec.device_decode if staged else codec.decode
        decode_add = codec.device_decode_add if staged else codec.decode_add
        t_dec = best_time(lambda: [decode(m, w, out=o) for m, w, o in zip(metas, wires, out_chunks)],
                          args.repeat, device)
        t_add = best_time(lambda: [decode_add(m, w, a, 0.5) for m, w, a in zip(metas, wires, acc_chunks)],
                          args.repeat, device)
        for m, w, o in zip(metas, wires, out_chunks):
            decode(m, w, out=o)
        err = (out - x).abs_()
        r = row(label, t_enc, t_dec, t_add, args.numel * 4 / wire_bytes, float(err.max()), float(err.mean()))
        encs.clear()  # (the next codec's buffers replace these)

    hdr = f"{'codec':<22}{'enc GB/s':>10}{'dec GB/s':>10}{'dec+add':>10}{'ratio':>8}{'max err':>11}{'mean err':>11}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['codec']:<22}{r['encode_GBps']:>10.2f}{r['decode_GBps']:>10.2f}{r['decode_add_GBps']:>10.2f}"
              f"{r['ratio']:>8.2f}{r['max_abs_err']:>11.3g}{r['mean_abs_err']:>11.3g}")
    print(f"({rows[0]['codec']} row: enc = dec = that chunked copy, dec+add = chunked acc.add_ of fp32; "
          "GB/s of fp32 input)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(threads=threads, device=str(device), numel=args.numel, chunk=args.chunk,
                           torch=torch.__version__, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
