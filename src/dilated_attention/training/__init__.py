"""Training a LongNet language model on bytes: data, loop, checkpoints, processes.

Needs the ``train`` extra (tqdm, matplotlib): ``pip install 'dilated-attention[train]'``.
"""

from .data import Corpus, load_corpus
from .trainer import TrainSettings, load_model, read_log, read_run_config, train

__all__ = ["TrainSettings", "train", "load_model", "read_log", "read_run_config", "Corpus", "load_corpus"]
