"""`python train.py ARGS` with DeepSpeed's INFO log on, so each pipeline engine logs its stage's layers
(`RANK=r STAGE=s LAYERS=n [start, stop)`): the cut a run used (tests/test_planner.py).

    python tests/partition_probe.py TRAIN_PY_ARGS ...
"""
import logging
import sys

from deepspeed.utils import logger

import train

if __name__ == "__main__":
    logger.setLevel(logging.INFO)
    for handler in logger.handlers:
        handler.setLevel(logging.INFO)
    sys.argv[0] = "train.py"
    train.run(sys.argv[1:])
