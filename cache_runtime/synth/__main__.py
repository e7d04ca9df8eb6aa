"""``python -m cache_runtime.synth --preset demo --out DIR``: writes a random-weight checkpoint into DIR.

Idempotent: a DIR that already holds a complete checkpoint written with the same arguments is left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cache_runtime.synth.checkpoint import DTYPES, PRESETS, checkpoint_stamp, is_complete, write_checkpoint
from cache_runtime.synth.tokenizer import CHAT_TEMPLATES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cache_runtime.synth", description=__doc__.split("\n")[0])
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--max-shard-mb", type=int, default=None, help="shard the weights into files of at most N MiB")
    p.add_argument("--template", default="chatml", choices=sorted(CHAT_TEMPLATES), help="chat template family")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    a = p.parse_args(argv)
    kwargs = dict(seed=a.seed, dtype=a.dtype, tokenizer_template=a.template, vocab_size=a.vocab_size,
                  max_shard_bytes=None if a.max_shard_mb is None else a.max_shard_mb << 20)
    if is_complete(a.out, checkpoint_stamp(a.preset, **kwargs)):
        print(f"{a.out}: up to date ({a.preset})")
        return 0
    write_checkpoint(a.out, a.preset, **kwargs)
    print(f"{a.out}: wrote {a.preset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
