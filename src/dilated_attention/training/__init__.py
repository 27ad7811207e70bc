"""Training a LongNet language model on bytes: data, loop, checkpoints, processes.

Needs the ``train`` extra (tqdm, matplotlib): ``python3 -m pip install -e ".[train]"`` in a clone.
"""

from . import tasks
from .data import Corpus, load_corpus
from .retrieval import evaluate_run
from .run_folder import read_log, read_run_config
from .settings import TrainSettings
from .trainer import load_model, train

__all__ = [
    "Corpus",
    "TrainSettings",
    "evaluate_run",
    "load_corpus",
    "load_model",
    "read_log",
    "read_run_config",
    "tasks",
    "train",
]
