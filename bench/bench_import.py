"""Peak memory of `nanopt import` against the checkpoint it writes (the target: under 1.3x, since the import
holds one tensor at a time, not the model).

Writes a Llama-shaped transformers checkpoint with random weights (default ~500M parameters, bf16, sharded like the
hub's), imports it in a fresh child process, and reports that process's peak RSS (VmHWM; Linux) next to the size of
the model.safetensors it wrote. The child imports torch and transformers-free nanopt only, so its baseline (the
interpreter and torch, a few hundred MB) is part of the number, as it is for a user.

    PYTHONPATH=$PWD python bench/bench_import.py --tokenizer T.json    # ~500M: ~1 GB bf16 source, ~2 GB fp32 out
    PYTHONPATH=$PWD python bench/bench_import.py --tokenizer T.json --hidden 64 --layers 2  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# The child's own peak: VmHWM, the high-water mark of its address space, which exec starts afresh. Not ru_maxrss:
# Linux carries that across fork and exec, so the child would report this process's peak (the source model it
# just built, ~2.5 GB at the default size) instead of the import's.
CHILD = """
import json, sys
from pathlib import Path
from nanopt.importer.run import import_model
report = import_model(sys.argv[1], Path(sys.argv[2]))
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": peak, "parameters": report.parameters, "checkpoint_bytes": report.checkpoint_bytes}))
"""


def write_source(directory: Path, hidden: int, layers: int, vocab: int, tokenizer: Path) -> None:
    import shutil

    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64
                                   or 64, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 256), max_position_embeddings=2048,
                                   tie_word_embeddings=True, torch_dtype="bfloat16")
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="500MB")
    shutil.copy(tokenizer, directory / "tokenizer.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json of at most --vocab tokens")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source, run = Path(tmp) / "source", Path(tmp) / "runs" / "imported"
        write_source(source, args.hidden, args.layers, args.vocab, args.tokenizer)
        done = subprocess.run([sys.executable, "-c", CHILD, str(source), str(run)], capture_output=True, text=True,
                              check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
    result["ratio"] = round(result["peak_rss"] / result["checkpoint_bytes"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
