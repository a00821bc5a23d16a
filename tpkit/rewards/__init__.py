"""Rewards: plain callables `(images, prompts, metadata) -> list[float]`.

`registry` names the built-ins (and imports `module:function` for users' own); `options` is what every
reward shares; one module per reward family: `clip` (PickScore, CLIPScore, aesthetic), `image_reward`,
`ocr`, `geneval`.
"""
