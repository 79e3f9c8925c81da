"""``fp4moe generate``: offline generation with our engine."""

from __future__ import annotations

from fp4moe.cli.options import (
    add_engine_options,
    check_device,
    engine_config,
)


def add(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with our engine from a bf16 or NVFP4 checkpoint",
        description=(
            "Load a qwen3_5_moe checkpoint (bf16 in any expert layout, or NVFP4 in ModelOpt or compressed-tensors "
            "form, experts kept packed) into fp4moe's engine and generate from a prompt. Text is streamed to stdout."
        ),
    )
    p.add_argument(
        "model",
        help="checkpoint directory; with --load-format dummy also a full-size name (qwen3.5-35b-a3b, "
        "qwen3.6-35b-a3b, or either with -nvfp4: experts in NVFP4): config and a synthetic tokenizer are "
        "written once under ~/.cache/fp4moe/full-size",
    )
    p.add_argument("prompt", help="the prompt (raw text, or a user message with --chat)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message with the chat template"
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="image file to show the model (repeatable); implies --chat unless the prompt has placeholders",
    )
    sampling = p.add_argument_group("sampling (vLLM's semantics)")
    sampling.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    sampling.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random"
    )
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    sampling.add_argument(
        "--top-p", type=float, default=1.0, help="sample among the smallest set with this much mass"
    )
    sampling.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    sampling.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="penalise tokens seen in prompt/output (>1)"
    )
    sampling.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract from tokens already generated"
    )
    sampling.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtract per time a token was generated"
    )
    sampling.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    sampling.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable); not included in the output"
    )
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    sampling.add_argument(
        "--stop-token-ids",
        type=int,
        nargs="+",
        default=[],
        help="token ids that end generation (kept in the ids)",
    )
    sampling.add_argument(
        "--include-stop-str-in-output", action="store_true", help="keep the matched stop string in the text"
    )
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt (printed one after another)")
    sampling.add_argument(
        "--logprobs", type=int, default=None, help="also print each token's log-probability and the top K"
    )
    add_engine_options(p, max_num_seqs=64, max_num_batched_tokens=8192)  # offline: LLM's defaults


def run(args) -> int:

    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.models.full_size import resolve

    args.model = resolve(args.model, args.load_format)
    config = engine_config(args)
    check_device(config.device)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        stop_token_ids=args.stop_token_ids,
        include_stop_str_in_output=args.include_stop_str_in_output,
        n=args.n,
        logprobs=args.logprobs,
    )
    llm = LLM(args.model, config)
    if args.image and "<|image_pad|>" not in args.prompt:
        content = [
            *({"type": "image", "image": f} for f in args.image),
            {"type": "text", "text": args.prompt},
        ]
        prompt = {
            "prompt": llm.apply_chat_template([{"role": "user", "content": content}]),
            "multi_modal_data": {"image": args.image},
        }
    elif args.chat:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = (
            {"prompt": args.prompt, "multi_modal_data": {"image": args.image}} if args.image else args.prompt
        )
    if args.n == 1 and args.logprobs is None:
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
        print()
        return 0
    for out in llm.generate(prompt, params)[0].outputs:
        if args.n > 1:
            print(f"--- completion {out.index} ({out.finish_reason}) ---")
        print(out.text)
        for r in out.logprobs or []:
            top = ", ".join(
                f"{llm.tokenizer.decode([t])!r}: {lp:.3f}" for t, lp in (r.top_logprobs or {}).items()
            )
            print(f"  {r.token_id:>7} {llm.tokenizer.decode([r.token_id])!r:<16} {r.logprob:8.3f}   [{top}]")
    return 0
