"""The reference recipe for serving a qwen3_5_moe checkpoint in stock vLLM: fp8 KV cache, YaRN x2, MTP
speculation, the reasoning and tool-call parsers, prefix caching. ``fp4moe serve --engine vllm`` prints it for
a machine; ``quantize`` writes it into the model card."""

from __future__ import annotations

import json

from fp4moe.models.qwen3_5_moe import text_config_dict


def yarn_overrides(config: dict) -> dict:
    """``--hf-overrides`` doubling the context with YaRN over the model's native positions."""
    text = text_config_dict(config)
    native = int(text.get("max_position_embeddings", 262144))
    rope = dict(text.get("rope_parameters") or {})
    return {
        "text_config": {
            "rope_parameters": {
                **rope, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": native
            },
            "max_position_embeddings": 2 * native,
        }
    }  # fmt: skip


def vllm_serve_command(
    model: str,
    config: dict,
    *,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_model_len: int | None = None,
    hf_overrides: dict | None = None,
    limit_mm_per_prompt: dict | None = None,
    max_num_seqs: int | None = None,
    num_speculative_tokens: int = 2,
) -> list[str]:
    """``vllm serve`` for ``model`` (its ``config`` the parsed config.json): the reference recipe, MTP with
    ``num_speculative_tokens`` drafts where the checkpoint has an MTP head (0: none)."""
    yarn = yarn_overrides(config)
    cmd = [
        "vllm", "serve", str(model),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--kv-cache-dtype", "fp8",
        "--max-model-len", str(max_model_len or yarn["text_config"]["max_position_embeddings"]),
        "--hf-overrides", json.dumps(hf_overrides or yarn),
        "--reasoning-parser", "qwen3",
        "--tool-call-parser", "qwen3_coder",
        "--enable-auto-tool-choice",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--limit-mm-per-prompt", json.dumps(limit_mm_per_prompt or {"image": 4}),
    ]  # fmt: skip
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if num_speculative_tokens and int(text_config_dict(config).get("mtp_num_hidden_layers", 0) or 0) > 0:
        cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": num_speculative_tokens})]
    return cmd
