"""The `tiny-shapes` testbed: `scenes` (procedural scenes of coloured shapes with GenEval-style prompts),
`detect` (a weight-free detector of them), `model` (pretraining the tiny SD3 on them)."""
