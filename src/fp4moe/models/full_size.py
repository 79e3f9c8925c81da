"""The full-size Qwen3.5/Qwen3.6-35B-A3B as a directory without weights, for ``--load-format dummy``.

``fp4moe serve qwen3.6-35b-a3b-nvfp4 --load-format dummy --device cuda`` serves the full-size model (random
weights, experts in NVFP4 as ``fp4moe quantize`` writes them) without its 22-70 GB: what speed measurements
need. The directory holds:

- ``config.json``: text + vision + MTP config with the released shapes (../shared/REFERENCE.md: 40 layers of
  3 Gated DeltaNet + 1 gated attention, hidden 2048, 256 experts top-8 of width 512, vocab 248,320, a 27-block
  vision tower merging to 2048, one MTP layer). Qwen3.5 and Qwen3.6 share the architecture and every shape
  (they differ in weights and in how the MTP experts are stored), so both names give the same config. The
  ``-nvfp4`` names add the ``quantization_config`` of our default output (routed experts NVFP4, the rest
  bf16); ``quantize_extra`` (as ``fp4moe quantize --quantize``) puts more groups in NVFP4 or FP8.
- a synthetic byte-level BPE tokenizer (trained on the packaged text) padded to all 248,320 ids, with the
  chat markup tokens at the ids of Qwen's layout (``<|endoftext|>`` = eos 248044, ``<|im_start|>``/
  ``<|im_end|>`` 248045/248046, vision 248053/248054, ``<|image_pad|>`` 248056, and tool/think markup at
  Qwen3's offsets from ``<|endoftext|>``) -- an assumption for the markup; only speed depends on it here.
- the chat template of our tiny checkpoints (Qwen3.5-style ChatML with qwen3_coder tool calls) and a
  generation config (eos ``<|im_end|>``, ``<|endoftext|>``).
"""

from __future__ import annotations

import json
from pathlib import Path

from fp4moe.models.qwen3_5_moe import REAL_TEXT_CONFIG

BASE_NAMES = ("qwen3.5-35b-a3b", "qwen3.6-35b-a3b")
NAMES = BASE_NAMES + tuple(f"{n}-nvfp4" for n in BASE_NAMES)

EOS_ID = 248044  # <|endoftext|>, the text config's eos_token_id
TOKEN_IDS = {  # Qwen's layout: the markup follows <|endoftext|> (Qwen3's offsets for tool and think markup)
    "<|endoftext|>": EOS_ID,
    "<|im_start|>": EOS_ID + 1,
    "<|im_end|>": EOS_ID + 2,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
    "<tool_call>": EOS_ID + 14,
    "</tool_call>": EOS_ID + 15,
    "<tool_response>": EOS_ID + 22,
    "</tool_response>": EOS_ID + 23,
    "<think>": EOS_ID + 24,
    "</think>": EOS_ID + 25,
}
VISION_CONFIG = (
    dict(  # 27 blocks of width 1152, patch 16, temporal 2, a 48x48 position grid, 2x2 merge -> 2048
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        in_channels=3,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=2048,
        num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
    )
)
TEXT_PREFIX = "model.language_model.layers.*."
# bf16 modules of our default output (routed experts NVFP4), as exclude entries vLLM's ModelOpt rule matches
_BF16_GROUPS = {
    "attention": [f"{TEXT_PREFIX}self_attn*"],
    "deltanet": [f"{TEXT_PREFIX}linear_attn*"],
    "shared": [f"{TEXT_PREFIX}mlp.shared_expert", f"{TEXT_PREFIX}mlp.shared_expert.*"],
    "lm_head": ["lm_head"],
}
_ALWAYS_BF16 = [
    f"{TEXT_PREFIX}linear_attn.in_proj_b",
    f"{TEXT_PREFIX}linear_attn.in_proj_a",
    f"{TEXT_PREFIX}linear_attn.conv1d",
    f"{TEXT_PREFIX}mlp.gate",
    f"{TEXT_PREFIX}mlp.shared_expert_gate",
    "model.language_model.embed_tokens",
    "model.visual*",
    "mtp*",
]


def full_size_config(name: str = "qwen3.6-35b-a3b-nvfp4", quantize_extra: tuple[str, ...] = ()) -> dict:
    """config.json of the full-size model (``name`` from ``NAMES``); ``-nvfp4``: with our default output's
    quantization_config, plus ``quantize_extra`` groups."""
    from transformers import Qwen3_5MoeConfig

    if name not in NAMES:
        raise ValueError(f"unknown full-size model {name!r}; choose from {', '.join(NAMES)}")
    text = {**REAL_TEXT_CONFIG, "eos_token_id": EOS_ID, "tie_word_embeddings": False}
    config = Qwen3_5MoeConfig(
        text_config=text,
        vision_config=dict(VISION_CONFIG),
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=False,
    ).to_dict()
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    config["dtype"] = "bfloat16"
    config["text_config"].update(
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        attn_output_gate=True,
        mamba_ssm_dtype="float32",
    )
    if name.endswith("-nvfp4"):
        config["quantization_config"] = _quantization_config(quantize_extra)
    elif quantize_extra:
        raise ValueError(f"{name} is the bf16 model: quantize_extra needs an -nvfp4 name")
    return config


def _quantization_config(quantize_extra: tuple[str, ...]) -> dict:
    from fp4moe.formats.layouts import modelopt_mixed_configs, modelopt_quantization_config
    from fp4moe.models.qwen3_5_moe import GROUPS, parse_groups, split

    options = parse_groups(list(quantize_extra))
    algos = dict(split(o) for o in options)
    exclude = list(_ALWAYS_BF16) + [
        e for g, entries in _BF16_GROUPS.items() if g not in algos for e in entries
    ]
    if "fp8" not in algos.values():
        return modelopt_quantization_config(exclude)
    layers = {
        f"model.language_model.layers.{i}.mlp.experts": "nvfp4"
        for i in range(REAL_TEXT_CONFIG["num_hidden_layers"])
    }
    for group, algo in algos.items():
        for names in GROUPS[group]:
            for module in names:
                if group == "lm_head":
                    layers["lm_head"] = algo
                    continue
                for i, kind in enumerate(REAL_TEXT_CONFIG["layer_types"]):
                    mixer = "self_attn" if kind == "full_attention" else "linear_attn"
                    if module.split(".")[0] in ("self_attn", "linear_attn") and module.split(".")[0] != mixer:
                        continue
                    layers[f"model.language_model.layers.{i}.{module}"] = algo
    return modelopt_mixed_configs(exclude, None, layers)[0]


def synthetic_tokenizer(vocab_size: int = REAL_TEXT_CONFIG["vocab_size"], trained: int = 8192):
    """A byte-level BPE of ``trained`` entries (Qwen3.5's pre-tokenizer, the packaged text) whose vocabulary is
    padded with ``<|fill_N|>`` entries to ``vocab_size`` ids, the markup at ``TOKEN_IDS``: every id the model
    can produce decodes."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from fp4moe.models.tiny import CHAT_TEMPLATE, MARKUP_TOKENS, SPECIAL_TOKENS, train_tokenizer

    data = json.loads(train_tokenizer(trained).backend_tokenizer.to_str())
    markup = set(SPECIAL_TOKENS) | set(MARKUP_TOKENS)
    assert markup == set(TOKEN_IDS), "the tiny tokenizer's markup and the full-size ids must agree"
    ordinary = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in markup]
    vocab = {t: i for i, t in enumerate(ordinary)}
    taken = set(TOKEN_IDS.values())
    vocab.update({f"<|fill_{i}|>": i for i in range(len(vocab), vocab_size) if i not in taken})
    vocab.update(TOKEN_IDS)  # the markup in the model's vocabulary too, so the added tokens keep these ids
    data["model"]["vocab"] = vocab
    data["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t, i in sorted(TOKEN_IDS.items(), key=lambda kv: kv[1])
    ]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_full_size(out: str | Path, name: str = "qwen3.6-35b-a3b-nvfp4", quantize_extra=()) -> Path:
    """The directory ``--load-format dummy`` serves: config, tokenizer, chat template, generation config and the
    image processor's config (vLLM builds the model's processor at start-up and fails without it). Written to a
    temporary name and renamed when complete."""
    import shutil
    import tempfile

    out = Path(out)
    config = full_size_config(name, tuple(quantize_extra))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        synthetic_tokenizer().save_pretrained(tmp)
        from fp4moe.models.tiny import PREPROCESSOR  # only when writing, as synthetic_tokenizer imports it

        # the tiny models' image processor (Qwen3-VL's: patches of 16, 2 x 2 merged, mean/std 0.5) with the
        # real model's pixel bounds (Qwen3-VL's processor: 256 to 16,384 merged tokens of 32 x 32 pixels)
        processor = {**PREPROCESSOR, "size": {"shortest_edge": 65_536, "longest_edge": 16_777_216}}
        (tmp / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
        eos = [TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"]]
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos, "do_sample": False}) + "\n"
        )
        if out.exists() and not _complete(out):
            shutil.rmtree(out, ignore_errors=True)  # an incomplete directory (written by hand, say)
        try:
            tmp.rename(out)
        except OSError:  # another process finished it first: keep theirs
            if not _complete(out):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _complete(path: Path) -> bool:
    return all((path / f).exists() for f in ("tokenizer.json", "preprocessor_config.json"))


def resolve(model: str, load_format: str, cache: Path | None = None) -> str:
    """A full-size name with ``--load-format dummy`` -> its directory (written once under ``cache``, default
    ~/.cache/fp4moe/full-size); anything else unchanged."""
    if load_format != "dummy" or model not in NAMES or Path(model).exists():
        return model
    cache = cache or Path.home() / ".cache" / "fp4moe" / "full-size"
    path = cache / model
    if not _complete(path):  # also a directory of an older fp4moe, written without the processor's config
        write_full_size(path, model)
    return str(path)
