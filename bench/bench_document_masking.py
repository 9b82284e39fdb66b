"""The CPU cost of cross-document attention masking (model.json `document_masking`): one training step's forward
and backward with the mask against the same model without it.

    OMP_NUM_THREADS=1 python bench/bench_document_masking.py        # hidden 128, 4 layers, seq 256, micro-batch 8
    python bench/bench_document_masking.py --seq-len 1024 --hidden 256 --layers 4 --repeats 5

Each row of the batch packs documents of random lengths (a mean of --doc-len tokens) split by EOS, as nanopt's
shards do. Both models have the same weights and inputs; the timings alternate between them, after one warm-up
step each, and the median of --repeats steps is kept. `ratio` is masked / unmasked step time: above 1, masking
costs that much more. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from nanopt.config import ModelConfig
from nanopt.model.transformer import Transformer

EOS = 0


def packed_batch(batch: int, seq_len: int, vocab: int, doc_len: int, generator: torch.Generator) -> torch.Tensor:
    ids = torch.randint(1, vocab, (batch, seq_len), generator=generator)
    ends = torch.rand(batch, seq_len, generator=generator) < 1 / doc_len  # a geometric document length
    return ids.masked_fill(ends, EOS)


def step_seconds(model: Transformer, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(ids, ids).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=64, help="mean document length in tokens")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    cfg = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 64,
                      max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    masked = Transformer(dataclasses.replace(cfg, document_masking=True, eos_token_id=EOS))
    masked.load_state_dict(plain.state_dict())
    ids = packed_batch(args.batch, args.seq_len, cfg.vocab_size, args.doc_len, torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"plain": [], "masked": []}
    for model in (plain, masked):
        step_seconds(model, ids)  # warm-up
    for _ in range(args.repeats):
        for name, model in (("plain", plain), ("masked", masked)):
            times[name].append(step_seconds(model, ids))
    plain_s, masked_s = statistics.median(times["plain"]), statistics.median(times["masked"])
    print(json.dumps({"seq_len": args.seq_len, "batch": args.batch, "hidden": args.hidden, "layers": args.layers,
                      "documents_per_row": round(float((ids == EOS).sum()) / args.batch + 1, 1),
                      "threads": torch.get_num_threads(), "plain_s": round(plain_s, 4),
                      "masked_s": round(masked_s, 4), "ratio": round(masked_s / plain_s, 3)}))


if __name__ == "__main__":
    main()
