"""GenEval: `judge` (the pure verdict and Flow-GRPO's dense score), `detectors` (the models that find
objects and their colours), `prompts` (GenEval-style prompt sets)."""
