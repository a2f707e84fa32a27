"""Training data: target-regenerated ShareGPT conversations in token shards with loss masks.

`build_dataset` writes a data folder (`dflow data`); `open_dataset` reads it back for the trainer
as a sequence of (input_ids [T], loss_mask [T]) with the loss on the target's own reply tokens.
"""

from dflow.data.build import DataConfig, build_dataset
from dflow.data.shards import open_dataset

__all__ = ["DataConfig", "build_dataset", "open_dataset"]
