"""tpkit: TP-GRPO and Flow-GRPO for flow-matching text-to-image models, as a staged offline pipeline.

Importing tpkit imports nothing heavy (no torch, no diffusers): the CLI stays fast.
"""

__version__ = "0.2.0"
