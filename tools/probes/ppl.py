"""Held-out perplexity of the top tier, as `mfs bench peers` measures it (the same windows: stdlib
pydoc held out, 256-token windows), for one --weights mode, eager, 2 threads; MFS_W4A8_TILES=0 for
w4a8's row layouts. usage: python tools/probes/ppl.py WEIGHTS [TOKENS=1024] [MODEL=default-raw]"""
import argparse
import sys

import torch


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(2)
    from benches.peers import _ppl, make_spec  # noqa: E402
    from worker.family import load_family  # noqa: E402

    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    model = sys.argv[3] if len(sys.argv) > 3 else "default-raw"
    a = argparse.Namespace(model=model, concurrency=16, prompt_len=16, mix="11,3,2", heldout_tokens=tokens, seq_len=256,
                           threads=2, device="cpu", new_tokens=64)
    spec = make_spec(a)
    m = load_family(spec.model, weights=sys.argv[1], device="cpu").model
    print(sys.argv[1], tokens, "tokens: ppl", round(_ppl(lambda ids: m.logits(m.exit_hidden(ids)[-1]), spec.windows), 4))


if __name__ == "__main__":
    main()
