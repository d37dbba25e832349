"""What compression and incremental checkpoints would save, on the state of a real training run.

Measures, before either is built into mpickpt (issue: incremental and compressed checkpoints):

1. **Codecs**: a small GPT-2 (built from a config, no downloaded weights) is trained for some steps
   on a synthetic language (a random sparse Markov chain: structured, learnable text, not noise)
   with AdamW; its fp32 weights, the same weights in bf16, the embeddings and Adam's two moments
   are then compressed in 4 MiB pieces by each codec on one thread: ratio, compression and
   decompression GB/s per core, and what a rank would write per second with ``--threads``
   compressing threads in front of a disk of ``--disk-GBps`` (measured by ``dd`` when not given).
2. **Incremental, LoRA**: the same model under ``peft`` LoRA (about 1% of the parameters
   trainable) with AdamW, checkpointed every ``--every`` steps: the share of the checkpoint's
   bytes that changed since the previous one, per tensor and per block of 1 MiB and 64 MiB
   (mpickpt's checksum block), compared by xxh3-64.
3. **Incremental, full fine-tune**: the same comparison for the whole model, and what the
   comparison costs: hashing every block of the state (xxh3) against mpickpt's ``save().wait()``
   of the same state on this machine (the save pipeline hashes every block anyway, so hashing before
   writing is the whole extra cost of deciding what to skip).

    python bench/bench_codecs.py                     # ~4 minutes on 2 cores
    python bench/bench_codecs.py --steps 400 --layers 6 --width 512

Needs ``pip install '.[bench-codecs]'`` (zstandard, blosc2, lz4, transformers, peft).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import columns

PIECE = 4 << 20


def markov_batches(vocab: int, batch: int, seq: int, seed: int = 0
                   ) -> Callable[[], torch.Tensor]:
    """Token batches from a random sparse Markov chain: each token has 4 possible successors."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)

    def draw() -> torch.Tensor:
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            pick = torch.randint(0, 4, (batch,), generator=g)
            x[:, t] = succ[x[:, t - 1], pick]
        return x
    return draw


def gpt(layers: int, width: int, vocab: int, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab,
                     n_positions=seq, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(cfg)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, draw: Callable[[], torch.Tensor],
          steps: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x = draw()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name: the model's state dict and the optimizer's state."""
    out = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out[f"optim.{names.get(id(p), id(p))}.{k}"] = v.detach()
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def codecs() -> dict[str, tuple[Callable[[bytes | memoryview, int], bytes],
                                Callable[[bytes], bytes]]]:
    """name -> (compress(data, itemsize), decompress(data)), each on one thread."""
    import blosc2
    import lz4.frame
    import zstandard

    blosc2.set_nthreads(1)
    out: dict[str, Any] = {}
    for level in (1, 3):
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        out[f"zstd-{level}"] = (lambda b, _s, c=c: c.compress(b), lambda b, d=d: d.decompress(b))
    out["lz4"] = (lambda b, _s: lz4.frame.compress(b), lz4.frame.decompress)
    for name, codec, filt in (("blosc2 zstd-1 byteshuffle", blosc2.Codec.ZSTD,
                               blosc2.Filter.SHUFFLE),
                              ("blosc2 lz4 bitshuffle", blosc2.Codec.LZ4,
                               blosc2.Filter.BITSHUFFLE)):
        def comp(b: Any, size: int, codec: Any = codec, filt: Any = filt) -> bytes:
            return blosc2.compress2(bytes(b), cparams={
                "codec": codec, "clevel": 1, "filters": [filt], "nthreads": 1, "typesize": size})
        out[name] = (comp, lambda b: blosc2.decompress2(b))
    return out


def classes(tensors: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    emb = ("wte", "wpe")
    out: dict[str, list[torch.Tensor]] = {"weights fp32": [], "weights bf16": [],
                                          "embeddings fp32": [], "Adam exp_avg": [],
                                          "Adam exp_avg_sq": []}
    for n, t in tensors.items():
        if not t.is_floating_point():
            continue
        if n.startswith("model."):
            if any(e in n for e in emb):
                out["embeddings fp32"].append(t)
            elif t.dim() >= 2:
                out["weights fp32"].append(t)
                out["weights bf16"].append(t.to(torch.bfloat16))
        elif n.endswith(".exp_avg"):
            out["Adam exp_avg"].append(t)
        elif n.endswith(".exp_avg_sq"):
            out["Adam exp_avg_sq"].append(t)
    return out


def pieces(ts: list[torch.Tensor]) -> list[tuple[memoryview, int]]:
    out = []
    for t in ts:
        b = tensor_bytes(t)
        out += [(b[i: i + PIECE], t.element_size()) for i in range(0, len(b), PIECE)]
    return out


def measure_codecs(groups: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {}
    for cname, (comp, decomp) in codecs().items():
        for gname, ts in groups.items():
            ps = pieces(ts)
            raw = sum(len(p) for p, _ in ps)
            t = time.perf_counter()
            packed = [comp(p, s) for p, s in ps]
            ct = time.perf_counter() - t
            t = time.perf_counter()
            for p, (orig, _) in zip(packed, ps, strict=True):
                if decomp(p) != bytes(orig):
                    raise RuntimeError(f"{cname} did not round-trip {gname}")
            dt = time.perf_counter() - t
            res.setdefault(cname, {})[gname] = {
                "bytes": raw, "ratio": raw / sum(len(p) for p in packed),
                "compress_GBps": raw / ct / 1e9, "decompress_GBps": raw / dt / 1e9}
    return res


def block_hashes(tensors: dict[str, torch.Tensor], block: int) -> dict[tuple[str, int], int]:
    out = {}
    for n, t in tensors.items():
        b = tensor_bytes(t)
        for i in range(0, max(len(b), 1), block):
            out[(n, i)] = xxhash.xxh3_64_intdigest(b[i: i + block])
    return out


def changed_share(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]
                  ) -> dict[str, float]:
    """The share of ``cur``'s bytes that differ from ``prev``: per tensor, per 1 MiB and 64 MiB
    block."""
    total = sum(t.numel() * t.element_size() for t in cur.values())
    out = {"state_bytes": total}
    changed = sum(t.numel() * t.element_size() for n, t in cur.items()
                  if n not in prev or not torch.equal(prev[n], t))
    out["tensor"] = changed / total
    for label, block in (("block 1 MiB", 1 << 20), ("block 64 MiB", 64 << 20)):
        a, b = block_hashes(prev, block), block_hashes(cur, block)
        size = {k: min(block, cur[k[0]].numel() * cur[k[0]].element_size() - k[1]) for k in b}
        out[label] = sum(size[k] for k in b if a.get(k) != b[k]) / total
    return out


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


def incremental(model: torch.nn.Module, opt: torch.optim.Optimizer,
                draw: Callable[[], torch.Tensor], every: int, rounds: int) -> list[dict]:
    train(model, opt, draw, 1)  # optimizer state exists
    prev = snapshot(state_tensors(model, opt))
    out = []
    for _ in range(rounds):
        train(model, opt, draw, every)
        cur = snapshot(state_tensors(model, opt))
        out.append(changed_share(prev, cur))
        prev = cur
    return out


def hash_vs_save(model: torch.nn.Module, opt: torch.optim.Optimizer, directory: str
                 ) -> dict[str, float]:
    """Seconds to hash every 64 MiB block of the state, against mpickpt's save().wait()."""
    import mpickpt

    tensors = state_tensors(model, opt)
    t = time.perf_counter()
    block_hashes(tensors, 64 << 20)
    hashed = time.perf_counter() - t
    root = os.path.join(directory, "mpickpt")
    saves = []
    with mpickpt.Checkpointer(root, keep=1) as ck:
        for i in range(3):
            t = time.perf_counter()
            ck.save(i, {"model": model, "optim": opt}).wait()
            saves.append(time.perf_counter() - t)
    shutil.rmtree(root, ignore_errors=True)
    save = sorted(saves)[1]
    return {"hash_s": hashed, "save_s": save, "hash_share_of_save": hashed / save}


def dd_write(directory: str, mb: int = 256) -> float:
    path = os.path.join(directory, "dd.bin")
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={mb // 4}",
                    "oflag=direct", "conv=fsync"], check=True, capture_output=True)
    s = time.perf_counter() - t
    os.unlink(path)
    return mb * (1 << 20) / s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300, help="training steps before measuring")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--every", type=int, default=10, help="steps between two checkpoints")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (on c_attn: ~1%% trainable)")
    ap.add_argument("--lora-targets", default="c_attn")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--disk-GBps", type=float, default=0.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default="bench/results/codecs.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    draw = markov_batches(args.vocab, args.batch, args.seq)
    res: dict[str, Any] = {"args": vars(args), "torch": torch.__version__}

    model = gpt(args.layers, args.width, args.vocab, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t = time.perf_counter()
    first = train(model, opt, draw, 1)
    last = train(model, opt, draw, args.steps - 1)
    res["train"] = {"steps": args.steps, "loss_first": first, "loss_last": last,
                    "seconds": time.perf_counter() - t}
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"GPT-2 {args.layers}x{args.width}, {params:.1f}M parameters, {args.steps} steps: "
          f"loss {first:.2f} -> {last:.2f}", flush=True)
    groups = classes(state_tensors(model, opt))
    res["codecs"] = measure_codecs(groups)
    disk = args.disk_GBps or dd_write(args.dir)
    res["disk_GBps"], res["threads"] = disk, args.threads
    rows = []
    for cname, per in res["codecs"].items():
        for gname, r in per.items():
            # a rank writes raw bytes at min(threads x compression speed, disk x ratio)
            r["write_GBps"] = min(args.threads * r["compress_GBps"], disk * r["ratio"])
            rows.append((cname, gname, f"{r['ratio']:.3f}", f"{r['compress_GBps']:.2f}",
                         f"{r['decompress_GBps']:.2f}", f"{r['write_GBps'] / disk:.2f}"))
    print(columns(("codec", "tensors", "ratio", "compress GB/s/core", "decompress GB/s/core",
                   f"write vs raw ({args.threads} threads, disk {disk:.2f} GB/s)"), rows))

    res["full"] = incremental(model, opt, draw, args.every, args.rounds)
    res["full_hash"] = hash_vs_save(model, opt, args.dir)

    from peft import LoraConfig, get_peft_model

    base = gpt(args.layers, args.width, args.vocab, args.seq)
    lora = get_peft_model(base, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                           target_modules=args.lora_targets.split(","),
                                           fan_in_fan_out=True))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    total = sum(p.numel() for p in lora.parameters())
    lopt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-3)
    res["lora_trainable_share"] = trainable / total
    res["lora"] = incremental(lora, lopt, draw, args.every, args.rounds)
    print(f"\nchanged bytes between checkpoints {args.every} steps apart (share of the "
          "checkpoint; median of rounds):")
    rows = []
    for label, runs in (("full fine-tune", res["full"]),
                        (f"LoRA ({trainable / total:.2%} trainable)", res["lora"])):
        med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
        rows.append((label, f"{med['state_bytes'] / 1e6:.1f}", f"{med['tensor']:.2%}",
                     f"{med['block 1 MiB']:.2%}", f"{med['block 64 MiB']:.2%}"))
    print(columns(("run", "state MB", "per tensor", "per 1 MiB block", "per 64 MiB block"), rows))
    h = res["full_hash"]
    print(f"\nfull fine-tune: hashing the whole state {h['hash_s']:.3f} s, mpickpt save().wait() "
          f"{h['save_s']:.3f} s ({h['hash_share_of_save']:.1%})")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
