"""How long a `--compile` worker's warm-up takes for the default family in w4a8 (ModelRunner.warm_up: the
graphs of the top tier and of each lower tier whose exit block runs compiled), and how many graphs it built.
Run with a fresh `TORCHINDUCTOR_CACHE_DIR` for the cold figure, again for the warm one.
usage: TORCHINDUCTOR_CACHE_DIR=/tmp/fresh python tools/probes/warm_up.py"""
import argparse
import time

import torch
from torch._dynamo.utils import counters

from engine import Engine
from worker.execution import compile_decode
from worker.family import add_model_args, load_from_args


def main() -> None:
    torch.set_num_threads(2)
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    model = load_from_args(ap.parse_args(["--model", "default-raw", "--weights", "w4a8"])).model
    compile_decode(model)
    t = time.time()
    Engine(model, block_size=16, num_blocks=1024).runner.warm_up()
    print(f"warm_up {time.time() - t:.1f} s, graphs {counters['stats']['unique_graphs']}")


if __name__ == "__main__":
    main()
