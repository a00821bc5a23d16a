"""The built-in models' names: laptop-sized, nothing downloaded (declared once, for the families, the
configs' defaults and `tpkit doctor`, none of which may import another's module for them)."""

TINY_MODEL = "tiny-sd3"  # random, built locally: proves plumbing
SHAPES_MODEL = "tiny-shapes"  # pretrained on coloured-shape scenes, shipped in the package: shows learning
FLUX_MODEL = "tiny-flux"  # random FLUX.1 in miniature, built locally: proves the FLUX plumbing
SHAPES_PICKSCORE = "tiny-shapes-pickscore"  # a CLIP preference model of the same scenes, shipped: the `pickscore` reward's testbed weights
QWEN_IMAGE_MODEL = "tiny-qwen-image"  # random Qwen-Image in miniature, built locally: proves the Qwen-Image plumbing
