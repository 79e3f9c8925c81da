"""Glue to the checkpoint's vision tower: transformers' ``Qwen3_5MoeVisionModel`` (ViT blocks, 2-D rotary,
learned position grid, 2x2 merger) holding the ``model.visual.*`` weights, built on the meta device.

Reusing transformers here is deliberate: the tower runs once per image and is not where the engine spends
its time; the language model it feeds is ours."""

from __future__ import annotations

import torch

from fp4moe.formats.checkpoint import CheckpointReader

PREFIX = "model.visual."


class VisionTower:
    def __init__(
        self, vision_config: dict, reader: CheckpointReader, dtype: torch.dtype, device: torch.device
    ):
        from transformers import Qwen3_5MoeVisionConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeVisionModel,
            Qwen3_5MoeVisionRotaryEmbedding,
        )

        cfg = Qwen3_5MoeVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = Qwen3_5MoeVisionModel(cfg)
        state = {n[len(PREFIX) :]: reader.get(n).to(dtype) for n in reader.names() if n.startswith(PREFIX)}
        model.load_state_dict(state, strict=True, assign=True)
        # non-persistent buffers (rotary inverse frequencies) are not in the checkpoint: compute them
        for module in model.modules():
            if isinstance(module, Qwen3_5MoeVisionRotaryEmbedding):
                inv_freq, _ = module.compute_axial_rope_parameters(module.config)
                module.inv_freq = inv_freq
                module.original_inv_freq = inv_freq.clone()
        meta = [n for n, b in model.named_buffers() if b.is_meta]
        if meta:
            raise RuntimeError(f"vision tower buffers left uninitialised: {meta}")
        self.model = model.to(device).eval()
        self.merge_size = cfg.spatial_merge_size
        self.dtype, self.device = dtype, device

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Embeddings [tokens_i, hidden] of each image (tokens_i = t*h*w / merge^2)."""
        out = self.model(pixel_values.to(self.device, self.dtype), grid_thw=grid_thw.to(self.device))
        sizes = (grid_thw.prod(-1) // self.merge_size**2).tolist()
        return list(torch.split(out.pooler_output, sizes))
