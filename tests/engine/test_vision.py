"""Images: our engine with the checkpoint's vision tower vs transformers, 32 greedy tokens; input errors."""

import base64
import io

import numpy as np
import pytest
import torch

from fixtures import no_eos
from fp4moe.cli import main
from fp4moe.engine.front.llm import LLM
from fp4moe.engine.request.multimodal import ImageError, expand_image_tokens, mrope_positions
from fp4moe.engine.request.sampler import SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints.bf16(), dtype="float32", limit_mm_per_prompt={"image": 2})


def _image(seed, h=70, w=90):
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


def _png_bytes(arr):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_image_prompt_greedy_matches_transformers(checkpoints, llm):
    from transformers import AutoImageProcessor, Qwen3_5MoeForConditionalGeneration

    images = [_image(0), _image(1, 40, 120)]
    content = [
        {"type": "image", "image": images[0]},
        {"type": "text", "text": "Compare"},
        {"type": "image", "image": images[1]},
        {"type": "text", "text": "please."},
    ]
    out = llm.chat(
        [{"role": "user", "content": content}], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    )[0]
    ids = out.prompt_token_ids
    image_token = llm.config["image_token_id"]
    path = checkpoints.bf16()
    ref = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    no_eos(ref)
    pixels = AutoImageProcessor.from_pretrained(str(path))(images=images, return_tensors="pt")
    inp = torch.tensor([ids])
    # transformers itself checks that the placeholder count equals the vision tower's output length
    expected = ref.generate(
        inp,
        pixel_values=pixels["pixel_values"],
        image_grid_thw=pixels["image_grid_thw"],
        mm_token_type_ids=(inp == image_token).int(),
        max_new_tokens=32,
        do_sample=False,
    )[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids == expected
    pos_ref, delta_ref = ref.model.get_rope_index(inp, (inp == image_token).int(), pixels["image_grid_thw"])
    pos, delta = mrope_positions(ids, image_token, pixels["image_grid_thw"], 2)
    assert torch.equal(pos, pos_ref[:, 0]) and delta == int(delta_ref)


def test_the_image_changes_the_output(llm):
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": _image(3)}, {"type": "text", "text": "hi"}],
            }
        ],
        p,
    )
    b = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": _image(4)}, {"type": "text", "text": "hi"}],
            }
        ],
        p,
    )
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids


def test_data_url_file_and_array_give_the_same_result(llm, tmp_path):
    arr = _image(5)
    png = _png_bytes(arr)
    (tmp_path / "x.png").write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = [
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": src}},
                        {"type": "text", "text": "?"},
                    ],
                }
            ],
            p,
        )[0]
        .outputs[0]
        .token_ids
        for src in (url, str(tmp_path / "x.png"))
    ] + [
        llm.chat(
            [{"role": "user", "content": [{"type": "image", "image": arr}, {"type": "text", "text": "?"}]}], p
        )[0]
        .outputs[0]
        .token_ids
    ]
    assert outs[0] == outs[1] == outs[2]


def test_image_errors(llm):
    p = SamplingParams(max_tokens=2)
    with pytest.raises(ImageError, match="limit is 2"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": _image(i)} for i in range(3)]}], p)
    with pytest.raises(ImageError, match="remote image URLs are not fetched"):
        llm.chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
                }
            ],
            p,
        )
    with pytest.raises(ImageError, match="cannot decode image"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}], p)
    with pytest.raises(ImageError, match="1 image placeholder"):
        llm.generate(
            {
                "prompt": "<|vision_start|><|image_pad|><|vision_end|>hi",
                "multi_modal_data": {"image": [_image(1), _image(2)]},
            },
            p,
        )


def test_placeholder_expansion():
    assert expand_image_tokens([1, 9, 2, 9], 9, [2, 3]) == [1, 9, 9, 2, 9, 9, 9]
    with pytest.raises(ImageError):
        expand_image_tokens([1, 9], 9, [2, 2])


def test_cli_generate_with_an_image(checkpoints, tmp_path, capsys):
    (tmp_path / "x.png").write_bytes(_png_bytes(_image(7)))
    code = main(
        [
            "generate",
            str(checkpoints.bf16()),
            "Describe it.",
            "--image",
            str(tmp_path / "x.png"),
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--dtype",
            "float32",
        ]
    )
    assert code == 0 and capsys.readouterr().out.strip()
    code = main(["generate", str(checkpoints.bf16()), "x", "--image", str(tmp_path / "missing.png")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_cli_generate_sampling_flags(checkpoints, capsys):
    code = main(
        [
            "generate",
            str(checkpoints.bf16()),
            "Hello",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--n",
            "2",
            "--temperature",
            "1.0",
            "--seed",
            "3",
            "--logprobs",
            "2",
            "--dtype",
            "float32",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "--- completion 0 (length) ---" in out and "--- completion 1 (length) ---" in out
    assert out.count("[") >= 6  # one logprob line per token, each with its top-2
    code = main(["generate", str(checkpoints.bf16()), "Hello", "--max-model-len", "100000000"])
    assert code == 2 and "exceeds the model's" in capsys.readouterr().err


def test_positions_of_chunks_that_end_inside_an_image_prompt():
    """Chunked prefill asks for the positions of any span: one that ends inside the prompt (it raised: a
    reversed arange), one that straddles its end, one after it."""
    from fp4moe.engine.request.sequence import Sequence

    prompt_positions = torch.tensor([[0, 1, 1, 1, 2], [0, 1, 1, 2, 3], [0, 1, 2, 1, 4]])
    seq = Sequence(0, [1, 2, 3, 4, 5], SamplingParams(), 0, prompt_positions=prompt_positions, rope_delta=-1)
    assert seq.positions(0, 3).tolist() == prompt_positions[:, :3].tolist()
    assert seq.positions(3, 7).tolist() == [[1, 2, 4, 5], [2, 3, 4, 5], [1, 4, 4, 5]]
    assert seq.positions(6, 8).tolist() == [[5, 6]] * 3
    chunks = torch.cat([seq.positions(a, b) for a, b in ((0, 2), (2, 4), (4, 6))], dim=1)
    assert chunks.tolist() == seq.positions(0, 6).tolist()
