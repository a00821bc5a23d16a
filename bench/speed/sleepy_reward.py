"""A reward that waits a fixed time per image (releasing the GIL), like a GPU or remote reward
model does, and returns the mean pixel value. Used by bench/speed/score_overlap.py only."""

import time

import numpy as np

SECONDS_PER_IMAGE = 0.015


def sleepy(images, prompts, metadata):
    time.sleep(SECONDS_PER_IMAGE * len(images))
    return [float(np.asarray(im, dtype=np.float64).mean()) for im in images]
