"""The fp4moe command: every option documented, the embedded demo end to end."""

import argparse

import pytest

from fp4moe.cli import build_parser, main
from fp4moe.cli.serve import vllm_command


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("command", sorted(_subparsers(build_parser())))
def test_every_option_has_help(command):
    sub = _subparsers(build_parser())[command]
    assert sub.description
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 10, f"{command} {action.dest} has no help"


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "result                               OK" in out
    assert "mean KL" in out and "experts calibrated: 32/32" in out
    assert "24 tokens:" in out  # the engine generated from the quantized checkpoint
    assert (tmp_path / "tiny-nvfp4-modelopt" / "config.json").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and "fp4moe" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_speculative_tokens_default_to_auto(command):
    base = ["m", "x"] if command == "generate" else ["m"]
    args = build_parser().parse_args([command, *base])
    assert args.num_speculative_tokens == "auto"
    assert (
        build_parser().parse_args([command, *base, "--num-speculative-tokens", "3"]).num_speculative_tokens
        == 3
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *base, "--num-speculative-tokens", "-1"])
    assert build_parser().parse_args([command, *base]).speculative_draft_vocab == 0  # off
    assert (
        build_parser()
        .parse_args([command, *base, "--speculative-draft-vocab", "32768"])
        .speculative_draft_vocab
        == 32768
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *base, "--speculative-draft-vocab", "-5"])


def test_auto_speculation_is_off_on_the_cpu(checkpoints):
    """auto drafts only where the fused round pays (the GPU engine with an MTP head); on the CPU it is 0,
    also for a checkpoint without an MTP head (no error, unlike an explicit k > 0)."""
    from fp4moe.engine.front.llm import LLM

    assert LLM(checkpoints.bf16(), num_speculative_tokens="auto").speculator is None


def test_generate_and_serve_declare_the_engine_options_once():
    """One EngineConfig from the same options for both commands (declared by one function)."""
    from fp4moe.cli.options import engine_config
    from fp4moe.engine.front.config import EngineConfig

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    fields = {f"--{name.replace('_', '-')}" for name in EngineConfig.__dataclass_fields__} - {"--cuda-graphs"}
    for command in ("generate", "serve"):
        options = {o for a in sub[command]._actions for o in a.option_strings}
        assert fields <= options, (command, fields - options)
    argv = ["--device", "cpu", "--limit-mm-per-prompt", "2", "--kv-cache-dtype", "fp8", "--max-num-seqs", "3",
            "--max-num-batched-tokens", "512", "--max-cached-tokens", "4096", "--no-enable-chunked-prefill"]  # fmt: skip
    gen = engine_config(build_parser().parse_args(["generate", "m", "hi", *argv]))
    srv = engine_config(build_parser().parse_args(["serve", "m", *argv]))
    assert gen == srv
    assert gen.limit_mm_per_prompt == {"image": 2} and gen.kv_cache_dtype == "fp8" and gen.max_num_seqs == 3
    assert (gen.max_num_batched_tokens, gen.max_cached_tokens, gen.enable_chunked_prefill) == (
        512,
        4096,
        False,
    )
    for bad in ("{image", "true", '{"image": -1}', '{"image": false}'):
        with pytest.raises(ValueError, match="limit-mm-per-prompt"):
            engine_config(build_parser().parse_args(["serve", "m", "--limit-mm-per-prompt", bad]))
    assert build_parser().parse_args(["generate", "m", "hi"]).max_num_seqs == 64  # offline: LLM's default
    assert build_parser().parse_args(["serve", "m"]).max_num_seqs == "auto"  # 16 on the CPU, memory on a GPU
    assert build_parser().parse_args(["generate", "m", "hi"]).max_num_batched_tokens == 8192

    # serve's step budget: vLLM's 8,192 on the GPU, 2,048 on the CPU; a prefill graph holds a whole step by
    # default, up to 8,192 tokens, and an eighth more rows for their padding; set values stand
    def budget_and_rows(*argv):
        c = engine_config(build_parser().parse_args(list(argv)))
        return c.max_num_batched_tokens, c.graph_rows

    assert build_parser().parse_args(["serve", "m"]).max_num_batched_tokens == "auto"
    assert budget_and_rows("serve", "m", "--device", "cpu") == (2048, 2304)
    assert budget_and_rows("serve", "m", "--device", "cuda") == (8192, 9216)
    assert budget_and_rows("generate", "m", "hi", "--device", "cpu") == (8192, 9216)
    assert budget_and_rows("serve", "m", "--max-num-batched-tokens", "16384") == (16384, 9216)
    argv = [
        "serve",
        "m",
        "--device",
        "cuda",
        "--max-num-batched-tokens",
        "1024",
        "--prefill-graph-tokens",
        "4096",
    ]
    assert budget_and_rows(*argv) == (1024, 4096)
    with pytest.raises(SystemExit):  # argparse's usage error
        build_parser().parse_args(["serve", "m", "--max-num-batched-tokens", "0"])


def test_llm_takes_an_engine_config_and_keyword_overrides(checkpoints):
    from fp4moe.engine.front.config import EngineConfig
    from fp4moe.engine.front.llm import LLM

    llm = LLM(checkpoints.bf16(), EngineConfig(dtype="float32", max_model_len=128), max_model_len=64)
    assert llm.engine_config.max_model_len == llm.max_model_len == 64
    assert (
        llm.model.embed_tokens.dtype.is_floating_point
        and str(llm.model.embed_tokens.dtype) == "torch.float32"
    )


def test_max_num_seqs_auto_sizes_by_memory(checkpoints):
    """serve's default: on the GPU the largest graph bucket whose per-sequence states take at most a quarter
    of what the model leaves (H200-sized arithmetic below: 61 MiB of Gated DeltaNet state per sequence of the
    full-size model, 243 MiB with speculation's history and ring at k = 2), 16 on the CPU; never more than 256."""
    from fp4moe.engine.device.memory import auto_max_num_seqs
    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.runner.cuda_runner import GRAPH_BATCH_SIZES

    gib, mib = 2**30, 2**20
    import torch

    from fp4moe.engine.device.memory import state_bytes_per_sequence
    from fp4moe.models.full_size import REAL_TEXT_CONFIG
    from fp4moe.models.qwen3_5_moe import ModelArgs

    full = ModelArgs.from_text_config(REAL_TEXT_CONFIG)  # the figures below, from the full-size shapes
    assert round(state_bytes_per_sequence(full, torch.bfloat16) / mib) == 61
    assert round(state_bytes_per_sequence(full, torch.bfloat16, 2) / mib) == 243
    plain, spec = (
        state_bytes_per_sequence(full, torch.bfloat16),
        state_bytes_per_sequence(full, torch.bfloat16, 2),
    )
    total, used = 141 * gib, 22 * gib  # an H200 with the NVFP4 model loaded
    assert auto_max_num_seqs(total, used, 0.9, plain, GRAPH_BATCH_SIZES) == 256  # 15 GiB of states: capped
    assert auto_max_num_seqs(total, used, 0.9, spec, GRAPH_BATCH_SIZES) == 96  # 23 GiB; 128 would be 30
    assert auto_max_num_seqs(total, 120 * gib, 0.9, spec, GRAPH_BATCH_SIZES) == 4
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        auto_max_num_seqs(total, 126 * gib, 0.9, spec, GRAPH_BATCH_SIZES)
    llm = LLM(checkpoints.bf16(), dtype="float32", max_num_seqs="auto")
    assert llm.engine_config.max_num_seqs == 16 and llm.new_core().scheduler.config.max_num_seqs == 16
    path = str(checkpoints.bf16())
    assert "--max-num-seqs" not in vllm_command(
        build_parser().parse_args(["serve", path, "--engine", "vllm"])
    )
    given = build_parser().parse_args(["serve", path, "--engine", "vllm", "--max-num-seqs", "48"])
    assert "--max-num-seqs 48" in " ".join(vllm_command(given))  # auto: vLLM's own default; a count passes
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--max-num-seqs", "0"])
