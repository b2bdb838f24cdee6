"""End-to-end efficiency: megatronapp against the PyTorch-native stack (the
e2e suite of benchmarks/peers/run.py: DTensor TP x DDP, + PowerSGD, pipelining
1F1B and zero-bubble, against ours).

    python benchmarks/e2e/run.py                      # both topologies (needs root)
    python benchmarks/e2e/run.py --topology two-node --repeats 1

Every option of benchmarks/peers/run.py applies; results go to
benchmarks/results/e2e/ (e2e.md, e2e.json, e2e.png).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "peers"))
import run as peers  # noqa: E402  (benchmarks/peers/run.py)

if __name__ == "__main__":
    peers.main(suite="e2e", out=os.path.join(os.path.dirname(HERE), "results", "e2e"))
