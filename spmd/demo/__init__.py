"""The demo: a domain-parallel CNN that learns one step of 2-D heat diffusion.

``heat`` holds the pieces (data, model, both trainings) for scripts and notebooks;
``cli`` is ``python -m spmd demo``; ``unet``, a plain U-Net the planner's examples split.
"""
from .heat import (
    SPEC,
    HeatCNN,
    History,
    heat_data,
    heat_step,
    make_model,
    max_param_diff,
    train_sharded,
    train_single,
)
from .unet import UNet

__all__ = ["UNet", "SPEC", "heat_step", "heat_data", "HeatCNN", "make_model", "History",
           "train_single", "train_sharded", "max_param_diff"]
