"""fp4moe: NVFP4 for fused-expert MoE models -- quantize, check, serve, measure."""

__version__ = "0.1.0"
